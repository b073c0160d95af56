"""Operating the app: metrics, diagnosis, tracing, retention and reports."""
