"""The replica's end of a caller's channel (the gateway's end is gateway/cluster/channel.py): the
deltas of every request a caller started on this replica, handed over as one batch per read,
and the mailbox that brings them from the engine's thread to the replica's event loop.

Across processes each streamed item costs about a millisecond of CPU at each end, whatever
its size (Ray's streaming generators), so one item per engine step instead of one per request
per step is what lets HTTP keep up with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from worker.contract.calls import Delta


class Mailbox:
    """Deltas from the engine's thread to their receivers on one event loop, with one wakeup
    of that loop for everything posted before it runs (a step's deltas for every request),
    not one per delta: under load the loop wakes once per engine step. With `step_lock` (the
    engine loop's `delivering`), a wakeup that comes while a step's deltas are being posted
    waits for the rest of them, so they reach the loop together."""

    def __init__(self, loop: asyncio.AbstractEventLoop, step_lock: threading.Lock | None = None) -> None:
        self.loop = loop
        self._step_lock = step_lock
        self._items: list[tuple[Callable[[Delta], None], Delta]] = []
        self._pending = False
        self._lock = threading.Lock()

    def post(self, receive: Callable[[Delta], None], delta: Delta) -> None:
        """From any thread: `receive(delta)` runs on the loop (with the rest posted meanwhile)."""
        with self._lock:
            self._items.append((receive, delta))
            if self._pending:
                return
            self._pending = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: the caller cancels its request
            with self._lock:
                self._pending = False
            raise

    def _flush(self) -> None:
        with self._step_lock or contextlib.nullcontext(), self._lock:
            items, self._items, self._pending = self._items, [], False
        for receive, delta in items:
            receive(delta)


def coalesced(deltas: list[Delta]) -> list[Delta]:
    """Each request's consecutive deltas of one choice as one (a caller behind by several
    steps gets them together); the order within each request is kept."""
    out: list[Delta] = []
    latest: dict[str, int] = {}  # request id -> its last delta's place in `out`
    for delta in deltas:
        i = latest.get(delta.request_id)
        if i is not None and out[i].index == delta.index and out[i].finish_reason is None:
            out[i] = out[i].merged(delta)
        else:
            latest[delta.request_id] = len(out)
            out.append(delta)
    return out


class CallerChannel:
    """The replica's end of one caller's channel: the deltas of the requests started on it,
    handed over as one batch per read (everything since the last one), on the event loop."""

    def __init__(self) -> None:
        self.running: dict[str, Any] = {}  # request id -> its engine subscription (None while it is being submitted)
        self.cancelled: set[str] = set()  # cancelled while being submitted
        self.closed = False
        self._deltas: list[Delta] = []
        self._ready = asyncio.Event()

    def add(self, delta: Delta) -> None:
        self._deltas.append(delta)
        self._ready.set()
        if delta.is_finished:
            self.running.pop(delta.request_id, None)

    async def batch(self, timeout_s: float | None = None) -> list[Delta]:
        """Everything since the last batch, once there is something; empty after `timeout_s` without."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        except TimeoutError:
            return []
        self._ready.clear()
        deltas, self._deltas = self._deltas, []
        return coalesced(deltas)

    def close(self) -> None:
        """The caller is gone: its requests stop and free their KV slots."""
        self.closed = True
        running, self.running = self.running, {}
        for subscription in running.values():
            if subscription is not None:
                subscription.cancel()
