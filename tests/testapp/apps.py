import os

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    verbose_name = "agentruns test agents"

    def ready(self) -> None:
        # A worker subprocess of older code, as in a rolling deploy: the agents named in
        # AGENTRUNS_TEST_HIDE_AGENTS (comma-separated) are not registered in it. Runs after
        # django_agentruns' ready(), which registered them (INSTALLED_APPS order).
        from django_agentruns.registry import unregister

        for name in filter(None, os.environ.get("AGENTRUNS_TEST_HIDE_AGENTS", "").split(",")):
            unregister(name)
