"""How `runworker` makes its log lines visible without taking over the project's logging."""

from __future__ import annotations

import logging

APP_LOGGER = "django_agentruns"
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure(verbosity: int) -> None:
    """Show the app's INFO lines (DEBUG at -v 3) if the project's LOGGING does not already.

    Only the app's own logger is touched, never the root logger: a handler on the root
    would print every line of the project's own propagating loggers a second time. If the
    project gives the app's logger (or any logger above it) a handler, or a level, that is
    left as it is, save `-v 3` asking for DEBUG.
    """
    app = logging.getLogger(APP_LOGGER)
    if verbosity > 2:
        app.setLevel(logging.DEBUG)
    elif app.level == logging.NOTSET:
        app.setLevel(logging.INFO)
    if not app.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        app.addHandler(handler)
