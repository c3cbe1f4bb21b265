"""The engine on its own thread: submit from anywhere, get each request's deltas back (its
`Subscription`), cancel.

Submissions and cancellations are queued and applied between steps, so the
engine itself stays single-threaded.

Given a function that builds the engine instead of an engine, the loop builds it on its own
thread: then every torch call of the worker, the model's loading included, comes from one
thread. On CPU that matters: OpenMP keeps a team of threads per calling thread, and a model
loaded on one thread and run on another has two teams contending for the cores (a decode
step measured ~2x slower that way on 2 cores).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from worker.contract.calls import Delta
from worker.engine.engine import Engine, EngineRequest

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 30.0  # how long closing waits for the step in progress (the longest take seconds)


class Overloaded(RuntimeError):
    """The worker's queue is full: the request may go to another replica, or come back later."""


class Subscription:
    """Deltas of one request, in order; iteration ends after the finishing delta. With
    `on_output`, each delta goes to that callback instead, called on the engine's thread
    (it must not block: e.g. `call_soon_threadsafe` into an asyncio queue)."""

    def __init__(self, loop: EngineLoop, request_id: str, on_output: Callable[[Delta], None] | None = None) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.Queue[Delta] = queue.Queue()
        self._on_output = on_output

    def put(self, output: Delta) -> None:
        if self._on_output is None:
            self._queue.put(output)
            return
        try:
            self._on_output(output)
        except Exception as e:  # the receiver is gone (its event loop closed): stop computing for it
            log.info("request %s: its output could not be delivered (%s); cancelling it", self.request_id, e)
            if not output.is_finished:
                self.cancel()

    def get(self, timeout_s: float | None = None) -> Delta:
        return self._queue.get(timeout=timeout_s)

    def cancel(self) -> None:
        self._loop.cancel(self.request_id, self)

    def __iter__(self) -> Iterator[Delta]:
        while True:
            out = self._queue.get()
            yield out
            if out.is_finished:
                return


class EngineLoop:
    def __init__(self, engine: Engine | Callable[[], Engine], max_waiting: int | None = None) -> None:
        """`engine`, or a function building it on the loop's thread (its errors raise here)."""
        self.max_waiting = max_waiting  # requests waiting for a KV slot beyond which submit refuses (Overloaded)
        self._inbox: list[tuple[str, object]] = []
        self._unapplied: deque[tuple[str, object]] = deque()  # taken from the inbox, being applied
        self._subscriptions: dict[str, Subscription] = {}
        self._wake = threading.Condition()
        self.delivering = threading.Lock()  # held while a step's outputs are handed out (a receiver may wait for all of them)
        self._closed = False
        failed: list[BaseException] = []
        ready = threading.Event()
        if isinstance(engine, Engine):
            self.engine = engine
            ready.set()

        def run() -> None:
            if not ready.is_set():
                try:
                    self.engine = engine()
                except BaseException as e:  # raised in the constructor's thread
                    failed.append(e)
                    return
                finally:
                    ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name="loraplex-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def submit(self, request: EngineRequest, on_output: Callable[[Delta], None] | None = None) -> Subscription:
        """Queue a request; a bad one raises here (RequestError, ValueError) and changes nothing;
        Overloaded when `max_waiting` requests already wait for a slot.

        The prefix-cache lookup (a Redis round trip at most) runs here, in the
        caller's thread, not in the engine's step loop.
        """
        arrived_s = self.engine.clock()
        checked = self.engine.check(request)
        if self.max_waiting is not None and self.num_queued >= self.max_waiting:
            raise Overloaded(f"the worker is busy: {self.num_queued} requests are waiting for a slot")
        hit = self.engine.lookup(checked)
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            if request.request_id in self._subscriptions:
                raise ValueError(f"request id {request.request_id!r} is already running")
            subscription = self._subscriptions[request.request_id] = Subscription(self, request.request_id, on_output)
            self._inbox.append(("add", (checked, hit, arrived_s)))
            self._wake.notify()
        return subscription

    def call(self, fn: Callable[[Engine], Any]) -> Future:
        """Run `fn(engine)` on the engine's thread between steps (adding or removing an adapter);
        its result or exception comes in the future."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            self._inbox.append(("call", (fn, future)))
            self._wake.notify()
        return future

    def pending_adapter_slots(self) -> set[int]:
        """Adapter slots of requests submitted but not yet added to the engine (in the inbox, or taken
        from it and not applied yet: a `call` applied before them sees them too)."""
        with self._wake:
            return {slot for kind, item in (*self._inbox, *self._unapplied) if kind == "add"
                    for slot in item[0].request.scales_by_slot}

    def cancel(self, request_id: str, subscription: Subscription | None = None) -> None:
        """Cancel a running or queued request (only `subscription`'s, when given: an id may be reused)."""
        with self._wake:
            self._inbox.append(("cancel", (request_id, subscription)))
            self._wake.notify()

    @property
    def num_queued(self) -> int:
        """Requests that will wait for a KV slot: those not given one yet, beyond the free slots
        (an estimate: read outside the engine's thread)."""
        scheduler = self.engine.scheduler
        pending = sum(1 + len(seq.forks) for seq in scheduler.waiting)  # a request of n choices waits for n slots
        pending += sum(item[0].request.params.n for kind, item in list(self._inbox) if kind == "add")
        return max(0, pending - scheduler.num_free_slots)

    def num_queued_adds(self) -> int:
        """Requests submitted that the engine has not taken yet (an estimate: read outside its thread)."""
        return sum(1 for kind, _ in list(self._inbox) if kind == "add")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the engine's thread once its step is done; a thread stuck past `timeout_s` (a daemon) is
        left behind and said so, rather than holding whoever closes the worker."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %g s; left behind", timeout_s)

    def _deliver(self, out: Delta) -> None:
        subscription = self._subscriptions.get(out.request_id)
        if subscription is None:
            return
        if out.is_finished:
            with self._wake:
                self._subscriptions.pop(out.request_id, None)
        subscription.put(out)

    def _apply(self, commands: list[tuple[str, object]]) -> None:
        with self._wake:
            self._unapplied = deque(commands)
        while True:
            with self._wake:
                if not self._unapplied:
                    break
                kind, item = self._unapplied.popleft()
            if kind == "add":
                checked, hit, arrived_s = item
                try:
                    self.engine.add_request(checked, hit, arrived_s)
                except Exception as e:  # checked at submit; anything left fails this request only
                    self._deliver(Delta.failed(str(e), request_id=checked.request.request_id))
                continue
            if kind == "call":
                fn, future = item
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # the caller's to handle
                    future.set_exception(e)
                continue
            request_id, subscription = item
            if subscription is not None and self._subscriptions.get(request_id) is not subscription:
                continue  # that request already finished; the id now belongs to another
            out = self.engine.cancel(request_id)
            if out is not None:
                self._deliver(out)

    def _run(self) -> None:
        reason, error = "cancelled", None
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self.engine.has_work() and not self._closed:
                        self._wake.wait()
                    if self._closed:
                        break
                    commands, self._inbox = self._inbox, []
                started, counters = time.perf_counter(), self.engine.counters
                num_steps = counters.steps
                self._apply(commands)
                outputs = [*self.engine.expire(), *self.engine.step()]
                with self.delivering:
                    for out in outputs:
                        self._deliver(out)
                if counters.steps != num_steps:
                    counters.iteration(time.perf_counter() - started, len(outputs))
        except Exception as e:  # a bug, not a request: stop taking work, end every subscription
            log.exception("engine loop failed")
            reason, error = "error", f"internal error: {e}"
        with self._wake:
            self._closed = True
            left = list(self._subscriptions)
            unrun, self._inbox = [item for kind, item in self._inbox if kind == "call"], []
        for _, future in unrun:
            future.set_exception(RuntimeError("the engine loop is closed"))
        for request_id in left:  # closing: whatever is left ends now
            out = self.engine.cancel(request_id) if reason == "cancelled" else None
            self._deliver(out or Delta(finish_reason=reason, error=error, request_id=request_id))
