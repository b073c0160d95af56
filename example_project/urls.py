from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("agentruns/", include("django_agentruns.urls")),
    path("", include("example_project.demo.urls")),
]
