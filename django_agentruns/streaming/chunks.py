"""Live output: `ctx.stream(text)` chunks, sent at once, stored once per step.

A chunk goes to whoever watches the run (chunk_transport: NOTIFY on PostgreSQL, a small
table on SQLite) and into the attempt's buffer, nothing more: storing a row per token is
what `emit` would cost. At the next step boundary (`emit`, `checkpoint`, a wait, the end
of the attempt) each channel's buffered text becomes one `stream` event: an `EmitWrite`
with a deterministic id of the attempt's own (a write submitted twice adds one event; a
retry's different text is stored beside the earlier attempt's), written the way `emit`'s
is, through the worker's attempt store (awaited on the loop for an async attempt; alone
for `run_now`), so a page that opens later still shows the whole text. A cancelled
attempt's text is stored too; text past MAX_EVENTS_PER_RUN is dropped with a warning.
A channel's text longer than COALESCE_CHARS is coalesced at once, so the buffer stays
small. Chunks of an attempt that lost its lease are neither sent nor stored.

`stream_chunks(run_id)` gives the same live chunks to Python code, sync or async.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..conf import app_settings
from ..exceptions import InvalidInputError, LimitExceeded
from ..outcomes import Renewal, StopReason
from ..transitions import EmitWrite, Result
from ..validation import check_short_text, json_text, unstorable_text
from .transport import sender

STREAM = "stream"
"""The type of the stored event a boundary coalesces a channel's chunks into."""
MAX_CHANNEL = 100
"""Longest channel name, in characters."""
COALESCE_CHARS = 65_536
"""Buffered characters of one channel past which `stream` coalesces them at once."""

logger = logging.getLogger("django_agentruns.worker")

_NAMESPACE = uuid.UUID("0c6b1d5e-8a4f-4e0b-b3c2-6a4e9d1f7a21")


def stream_event_id(run_id: int, attempt: int, checkpoints: int, channel: str,
                    number: int) -> uuid.UUID:
    """Deterministic, and apart from `emit`'s ids: streaming more or less on a retry never
    shifts the ids of the run's other events. The attempt is part of it: a retry streams
    its own text (a model answers differently), which is stored beside the earlier
    attempt's, not taken for a replay of it; one write submitted twice (a lost commit
    acknowledgement) still adds one event."""
    return uuid.uuid5(_NAMESPACE, f"{run_id}:{attempt}:{checkpoints}:{channel}:{number}")


def check_chunk(text: Any, channel: Any) -> None:
    """A chunk is text and a channel a short name; anything else is a clear error."""
    check_short_text(channel, "A stream channel", MAX_CHANNEL)
    if not isinstance(text, str):
        raise InvalidInputError(f"ctx.stream() takes text (str), not {type(text).__name__}: "
                                f"{text!r:.80}")
    if unstorable_text(text):
        raise InvalidInputError("a streamed chunk cannot hold a NUL character or a surrogate "
                                f"code point: {text[:40]!r}")


@dataclass
class _Channel:
    sent: int = 0  # chunks streamed by the attempt on this channel
    stored: int = 0  # of them, those coalesced into stored events
    parts: list[str] = field(default_factory=list)
    chars: int = 0
    events: int = 0  # stream events written since the checkpoint below
    checkpoint: int = 0


@dataclass
class Pending:
    """One channel's text since the last boundary, and the event that will store it."""

    channel: str
    event_id: uuid.UUID
    payload: dict[str, Any]


class Buffer:
    """One attempt's chunks since its last boundary, per channel."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.channels: dict[str, _Channel] = {}
        self.capped = False  # the run's stream is full: the rest of the text is dropped

    def add(self, channel: str, text: str) -> tuple[int, bool]:
        """Buffer a chunk: its index in the channel, and whether to coalesce now."""
        with self.lock:
            state = self.channels.setdefault(channel, _Channel())
            index = state.sent
            state.sent += 1
            state.parts.append(text)
            state.chars += len(text)
            return index, state.chars >= COALESCE_CHARS

    def take(self, run_id: int, attempt: int, checkpoints: int) -> list[Pending]:
        """The stored events of everything buffered, in channel order; the buffer empties."""
        out = []
        with self.lock:
            for name, state in self.channels.items():
                if not state.parts:
                    continue
                if state.checkpoint != checkpoints:
                    state.checkpoint, state.events = checkpoints, 0
                event_id = stream_event_id(run_id, attempt, checkpoints, name, state.events)
                out.append(Pending(name, event_id, {
                    "channel": name, "text": "".join(state.parts), "attempt": attempt,
                    "first": state.stored, "end": state.sent}))
                state.events += 1
                state.stored = state.sent
                state.parts, state.chars = [], 0
        return out


# One buffer per attempt, keyed by its control object (gone with it).
_buffers: weakref.WeakKeyDictionary[Any, Buffer] = weakref.WeakKeyDictionary()
_buffers_lock = threading.Lock()


def buffer_of(control: Any) -> Buffer:
    with _buffers_lock:
        found = _buffers.get(control)
        if found is None:
            found = _buffers[control] = Buffer()
        return found


def stream(control: Any, text: str, channel: str) -> bool:
    """`ctx.stream`: check, send live, buffer. True: the buffer grew long, coalesce now.
    Never blocks (the send only queues for the sender thread), so `astream` may call it on
    the event loop."""
    check_chunk(text, channel)
    control.check()  # a stopped attempt streams nothing more; a sync agent stops here
    if not text:
        return False
    buffer = buffer_of(control)
    index, full = buffer.add(channel, text)
    sender().send(control.ref, channel, index, text,
                  lambda: control.stop_reason == StopReason.LEASE_LOST)
    return full


Prune = tuple[int, int, str, int]
"""(run_id, attempt, channel, end): the SQLite chunk rows a stored event covers."""


def event_writes(control: Any) -> list[tuple[list[EmitWrite], Prune]]:
    """Take the attempt's buffered text: per channel, the `stream` event writes that store
    it (several if it does not fit one event) and the prune that follows them.

    Built like `emit`'s writes, they go the same way: through the worker's attempt store
    (`control.write` / `control.awrite`), alone for `run_now`. They are stored despite a
    cancel request (readers saw the text live; the run's timeline keeps it), still
    fenced by the lease.
    """
    with _buffers_lock:
        buffer = _buffers.get(control)
    if buffer is None:
        return []
    ref = control.ref
    cap = int(app_settings.MAX_EVENTS_PER_RUN)
    out = []
    for pending in buffer.take(ref.run_id, ref.attempt, control.checkpoints):
        if buffer.capped:  # a stream never shrinks: no write (and failed batch) per step
            sender().prune(ref.run_id, ref.attempt, pending.channel, pending.payload["end"])
            continue
        base = pending.event_id
        writes = [EmitWrite(ref, base if number == 0 else uuid.uuid5(base, str(number)),
                            STREAM, payload, max_events=cap, despite_cancel=True)
                  for number, payload in enumerate(_fitting(pending.payload))]
        out.append((writes, (ref.run_id, ref.attempt, pending.channel, pending.payload["end"])))
    return out


def coalesce(control: Any) -> Renewal:
    """At a step boundary, from the attempt's thread: each channel's buffered text as one
    stored `stream` event, fenced like `emit`. The worst renewal is returned (the caller
    applies it); after a LOST one nothing more is written. Text past the run's events
    cap is dropped with a warning (as a checkpoint's marker is left out), never an error:
    the boundary's own write must still happen, or the run could never finish."""
    worst = Renewal.OK
    for writes, prune in event_writes(control):
        for write in writes:
            if _capped(control):
                break
            try:
                worst = _worse(worst, control.write(write))
            except LimitExceeded:
                _over_cap(control, write)
                break
            if worst is Renewal.LOST:
                return worst  # fenced: nothing was stored, and nothing more will be
        sender().prune(*prune)
    return worst


async def acoalesce(control: Any) -> Renewal:
    """`coalesce` on the event loop: each write awaited through the store, no thread."""
    worst = Renewal.OK
    for writes, prune in event_writes(control):
        for write in writes:
            if _capped(control):
                break
            try:
                worst = _worse(worst, await control.awrite(write))
            except LimitExceeded:
                _over_cap(control, write)
                break
            if worst is Renewal.LOST:
                return worst
        sender().prune(*prune)
    return worst


def _capped(control: Any) -> bool:
    with _buffers_lock:
        buffer = _buffers.get(control)
    return buffer is not None and buffer.capped


def _over_cap(control: Any, write: EmitWrite) -> None:
    """Once per attempt: from now on its streamed text is live only."""
    buffer_of(control).capped = True
    logger.warning("run %s: its stream holds MAX_EVENTS_PER_RUN (%s) events; streamed text "
                   "from here on (%s characters on channel %r now) is not stored",
                   write.ref.run_id, write.max_events, len(write.payload.get("text", "")),
                   write.payload.get("channel"))


def _worse(worst: Renewal, result: Result) -> Renewal:
    assert isinstance(result, Renewal), result
    return result if result is Renewal.LOST or worst is Renewal.OK else worst


def flush_sent(control: Any) -> None:
    """Before a wait, from the attempt's thread: wait until the chunks this attempt sent are
    delivered. The sender gathers for BATCH_INTERVAL and fences each write on the attempt;
    a wait committed meanwhile (the run `waiting`, no longer this attempt's) would have the
    last chunks before it dropped, unseen by every reader."""
    if _buffers.get(control) is not None:
        sender().flush()


def finish(control: Any, *, store: bool) -> None:
    """At the end of the attempt, before it settles: coalesce what is left, unless the
    lease is lost (then nothing is written). Never raises: the text is live output, the
    outcome is what must be recorded."""
    try:
        if store:
            if _buffers.get(control) is not None:
                sender().flush()  # the last chunks go out live before the run ends
            coalesce(control)
    except Exception:
        _finish_failed(control)
    finally:
        _drop(control)


async def afinish(control: Any, *, store: bool) -> None:
    """`finish` for an async attempt, never blocking the loop: the flush waits in a
    thread, the writes are awaited through the store."""
    try:
        if store:
            if _buffers.get(control) is not None:
                await asyncio.get_running_loop().run_in_executor(None, sender().flush)
            await acoalesce(control)
    except Exception:
        _finish_failed(control)
    finally:
        _drop(control)


def stores_at_finish(stop_reason: StopReason | None) -> bool:
    """Whether the end of an attempt stores its leftover text: not once its lease is lost
    (fenced), nor once it waits (its wait released the lease; `receive` coalesced first)."""
    return stop_reason not in (StopReason.LEASE_LOST, StopReason.WAITING)


def _finish_failed(control: Any) -> None:
    logger.warning("run %s: storing the streamed text at the end of the attempt failed",
                   control.ref.run_id, exc_info=True)


def _drop(control: Any) -> None:
    with _buffers_lock:
        _buffers.pop(control, None)


def _fitting(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The payload, cut into several whose JSON fits MAX_EVENT_BYTES if it does not."""
    limit = int(app_settings.MAX_EVENT_BYTES)
    if len(json_text(payload, "stream")) <= limit:
        return [payload]
    text = payload["text"]
    half = len(text) // 2
    return [*_fitting({**payload, "text": text[:half]}),
            *_fitting({**payload, "text": text[half:]})]


# --------------------------------------------------------------------------- readers
