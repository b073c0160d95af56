"""Checks on what callers hand in to be stored: plain JSON, storable text, size caps.

Used by `api` (inputs, reasons), `tasks` (return values), the executor (error text) and
`RunContext` (payloads, state). No database here.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any, TypeGuard

from django.utils import timezone

from .conf import SETTING_NAME, app_settings
from .exceptions import InvalidInputError, LimitExceeded
from .outcomes import KEY_MAX, RESERVED_PREFIX

# Deeper JSON is refused: SQLite's JSON functions stop at 1000 levels, PostgreSQL does not.
MAX_JSON_DEPTH = 500
# Text neither engine stores alike: PostgreSQL refuses NUL in text and jsonb, and surrogate
# code points are not Unicode text at all (a pair given as two of them comes back as one).
_UNSTORABLE_TEXT = re.compile("[\x00\ud800-\udfff]")


def unstorable_text(text: str) -> bool:
    """Whether `text` holds a NUL character or a surrogate code point."""
    return _UNSTORABLE_TEXT.search(text) is not None


def is_short_text(value: Any, longest: int, *, empty: bool = False) -> TypeGuard[str]:
    """Whether `value` fits a short text column (a name, a key, a channel) alike on every
    engine: a str of 1 (0 if `empty`) to `longest` characters, no NUL or surrogate."""
    return isinstance(value, str) and (empty or value != "") and len(value) <= longest \
        and not unstorable_text(value)


def check_short_text(value: Any, what: str, longest: int) -> str:
    """`value` if it `is_short_text`; else InvalidInputError saying what `what` must be."""
    if not is_short_text(value, longest):
        raise InvalidInputError(f"{what} must be a string of 1-{longest} characters with no "
                                f"NUL or surrogate, not {value!r:.120}")
    return value


def storable_text(text: str) -> str:
    """Free text (an error message, a reason) as every engine stores it: NUL characters and
    surrogates written as backslash escapes, the rest unchanged."""
    if not unstorable_text(text):
        return text
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def ensure_json(value: Any, what: str) -> Any:
    """Return `value` if it is plain JSON (no NaN, no objects), else raise a clear error.

    The value must also store the same on every engine: no NUL characters or surrogates
    in its text, no nesting deeper than MAX_JSON_DEPTH.
    """
    json_text(value, what)
    return value


# One encoder for every call: json.dumps() builds a new one whenever it is given options.
_STRICT_JSON = json.JSONEncoder(allow_nan=False)


def json_text(value: Any, what: str) -> str:
    """`value` as JSON text, checked as `ensure_json` checks it: the text enqueue stores.

    The walk over the value runs only when the text shows it might find something: the
    encoder escapes every NUL and surrogate (``\\u0000``, ``\\udXXX``), and nesting deeper
    than MAX_JSON_DEPTH takes more opening brackets than that. Most values skip it.
    """
    try:
        text = _STRICT_JSON.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{what} must be JSON-serialisable: {exc}") from exc
    suspect = "\\u0000" in text or "\\ud" in text \
        or text.count("[") + text.count("{") > MAX_JSON_DEPTH
    problem = _unstorable(value) if suspect else None
    if problem is None and "{" in text:  # no brace in the text, no dict in the value
        problem = _odd_key(value)
    if problem:
        raise InvalidInputError(f"{what} cannot be stored: {problem}")
    return text


def capped_json(value: Any, what: str, setting: str) -> str:
    """`json_text`, refused with `LimitExceeded` if longer than the size cap `setting`."""
    text = json_text(value, what)
    limit = int(getattr(app_settings, setting))
    # The encoder escapes every non-ASCII character, so the text's length is its size.
    if len(text) > limit:
        raise LimitExceeded(f"{what} is {len(text)} bytes as JSON, over the limit of {limit} "
                            f"bytes ({SETTING_NAME}['{setting}'])")
    return text


def _odd_key(value: Any) -> str | None:
    """A dict key that is not a string, if any: JSON would turn 1 into "1" (and merge it
    with a "1" beside it), so the value would not come back as it was given."""
    stack = [value]
    containers = (dict, list, tuple)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return f"the key {key!r} is not a string (JSON keys are strings)"
            stack.extend(v for v in item.values() if isinstance(v, containers))
        else:
            stack.extend(v for v in item if isinstance(v, containers))
    return None


def _unstorable(value: Any) -> str | None:
    """What in a JSON-serialisable value no engine stores faithfully, if anything."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if unstorable_text(item):
                return f"the text {item[:40]!r} holds a NUL character or a surrogate code point"
        elif isinstance(item, dict | list | tuple):
            if depth >= MAX_JSON_DEPTH:
                return f"it is nested more than {MAX_JSON_DEPTH} levels deep"
            if isinstance(item, dict):
                stack.extend((key, depth + 1) for key in item if isinstance(key, str))
                stack.extend((child, depth + 1) for child in item.values())
            else:
                stack.extend((child, depth + 1) for child in item)
    return None


# --------------------------------------------------------- keys and deadlines of waits

# The longest wait accepted: a deadline far enough out is no deadline (and would overflow).
MAX_TIMEOUT = 10 * 365 * 86400.0


def check_key(key: Any, what: str = "key") -> str:
    """A key callers may use: 1-KEY_MAX characters, storable, not the engine's own."""
    if not is_short_text(key, KEY_MAX) or key.startswith(RESERVED_PREFIX):
        raise InvalidInputError(
            f"{what} must be a string of 1-{KEY_MAX} characters with no NUL or surrogate, "
            f"not starting with {RESERVED_PREFIX!r}; not {key!r:.120}")
    return key


def deadline_after(timeout: Any) -> datetime | None:
    """`timeout` (seconds or a timedelta, None for none) as a deadline from now."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not 0 < timeout <= MAX_TIMEOUT:
        raise InvalidInputError(f"timeout must be seconds in (0, {MAX_TIMEOUT:.0f}] or a "
                                f"timedelta, not {timeout!r:.80}")
    return timezone.now() + timedelta(seconds=float(timeout))
