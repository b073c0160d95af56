from django.contrib import admin
from django.urls import include, path

from example_project.demo import views as demo_views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("agentruns/", include("django_agentruns.urls")),
    # The example project's live page, offering a test agent (tests/test_stream_browser.py).
    path("demo/live/", demo_views.live, {"runs": {"tests.live_steps": {"seconds": 60}}},
         name="demo-live"),
    # The page as the example project offers it: the Pydantic AI chat agent first
    # (tests/test_demo_chat.py registers demo.assistant).
    path("demo/chat/", demo_views.live, name="demo-chat"),
    # The same page offering an agent that streams its output (ctx.stream).
    path("demo/live-stream/", demo_views.live,
         {"runs": {"tests.streamer": {"n": 30, "gate": True, "after": 3}}}),
]
