"""Named argparse validators shared by the management commands."""

from __future__ import annotations

import argparse
import getpass

from django_agentruns.exceptions import InvalidInputError
from django_agentruns.registry import QUEUE_RULE, check_worker_names, is_queue_name

# Past this a count does not fit the database's integers (a LIMIT of 10**20 is a DataError).
LARGEST_COUNT = 2**31 - 1
LARGEST_ID = 2**63 - 1


def positive_int(text: str, most: int = LARGEST_COUNT) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {most}, not {value}")
    return value


def run_id(text: str) -> int:
    return positive_int(text, LARGEST_ID)


def worker_id(text: str) -> str:
    """Stored in every run the worker claims: it must fit, and be storable text."""
    try:
        check_worker_names([], text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, not {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, not {value}")
    return value


def queue_list(text: str) -> list[str]:
    queues = [q.strip() for q in text.split(",") if q.strip()]
    if not queues:
        raise argparse.ArgumentTypeError("name at least one queue")
    for queue in queues:
        if not is_queue_name(queue):
            raise argparse.ArgumentTypeError(f"a queue name is {QUEUE_RULE}, not {queue!r}")
    return queues


def os_user() -> str:
    """Who ran the command, as the OS knows them: recorded when nobody says (`--by`)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): say so, not nothing
        return "unknown OS user"
