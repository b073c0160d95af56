from django.urls import path
from django.views.generic import RedirectView

from . import views

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="demo-live")),
    path("demo/live/", views.live, name="demo-live"),
]
