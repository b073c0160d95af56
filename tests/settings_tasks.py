"""The test settings with Django's tasks framework on django-agentruns.

For worker subprocesses: with TASKS naming the backend, the app config registers the
internal agents that run `@task` functions, with no import of the backend anywhere else.
"""

from tests.settings import *  # noqa: F403

TASKS = {"default": {"BACKEND": "django_agentruns.tasks.AgentRunsBackend"}}
