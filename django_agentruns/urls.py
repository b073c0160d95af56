"""The app's own endpoints, for the web process: `path("agentruns/", include(...))`.

- `metrics/`: Prometheus metrics (staff with `view_agentrun`, or the METRICS_TOKEN bearer);
- `runs/<id>/events/`: a run's events as server-sent events (`view_agentrun`).
"""

from django.urls import path

from .ops import metrics
from .streaming import sse as stream

app_name = "agentruns"

urlpatterns = [
    path("metrics/", metrics.metrics_view, name="metrics"),
    path("runs/<int:run_id>/events/", stream.run_events, name="run-events"),
]
