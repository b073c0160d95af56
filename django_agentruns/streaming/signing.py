"""Signed, expiring links to one run's event stream (`stream_url`), and their check.

An app hands an end user the stream of their own run without giving them any permission:
`stream_url(run_id, expires=3600)` returns the stream's path with `?expires=<unix time>`
and `&signature=<HMAC>` (Django's signing with the project's SECRET_KEY, rotated keys in
SECRET_KEY_FALLBACKS still accepted). The signature covers the run id and the expiry, so
a link cannot be stretched in time nor pointed at another run. Reconnects keep the link
(the browser's EventSource reuses it), so a link works until it expires.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping
from urllib.parse import urlencode

from django.core.signing import BadSignature, Signer
from django.urls import reverse

from ..exceptions import InvalidInputError

SALT = "django_agentruns.stream"
"""Keeps these signatures apart from every other use of the project's SECRET_KEY."""
LONGEST = 366 * 24 * 3600
"""Longest lifetime of a link, in seconds (a year): a leaked link must end."""


class Signed(enum.Enum):
    """What a request's stream link says, if it carries one."""

    ABSENT = "absent"  # no signature: the user's permissions decide
    VALID = "valid"
    EXPIRED = "expired"
    INVALID = "invalid"  # tampered with, malformed, or another run's


def stream_url(run_id: int, *, expires: float = 3600) -> str:
    """The path of run `run_id`'s event stream, signed to be watched without any
    permission for `expires` seconds from now (default an hour)."""
    from ..api import run_id_of

    rid = run_id_of(run_id)
    if isinstance(expires, bool) or not isinstance(expires, int | float) \
            or not math.isfinite(expires) or not 0 < expires <= LONGEST:
        raise InvalidInputError(f"expires must be seconds in (0, {LONGEST}], not {expires!r}")
    until = math.ceil(time.time() + expires)
    query = urlencode({"expires": until, "signature": _signer().signature(_value(rid, until))})
    return f"{reverse('agentruns:run-events', args=[rid])}?{query}"


def check(query: Mapping[str, str], run_id: int, *, now: float | None = None) -> Signed:
    """Whether the query string (`request.GET`) signs run `run_id`'s stream now."""
    expires, signature = query.get("expires"), query.get("signature")
    if expires is None and signature is None:
        return Signed.ABSENT
    if not expires or not signature or not expires.isdigit():
        return Signed.INVALID
    try:
        _signer().unsign(f"{_value(run_id, int(expires))}:{signature}")
    except BadSignature:
        return Signed.INVALID
    return Signed.EXPIRED if int(expires) < (time.time() if now is None else now) \
        else Signed.VALID


def _value(run_id: int, until: int) -> str:
    return f"{int(run_id)}:{int(until)}"


def _signer() -> Signer:
    return Signer(salt=SALT)  # reads SECRET_KEY now (a test may override it)
