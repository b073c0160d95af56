"""A `@task` defined outside INSTALLED_APPS: enqueueing it is refused (a worker would not
import it). Imported only where the tasks framework is available."""

from django_agentruns.tasks.compat import task


@task
def outside() -> int:
    return 1
