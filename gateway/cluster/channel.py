"""The gateway's end of a replica's channel (the replica's end is worker/shard/channel.py): one
stream from the replica carries the deltas of every request this gateway process runs there, one
batch per engine step, and is shared out to each request's own queue here (torch-free, Ray-free: the
transport is three callables).

A replica that dies or restarts ends the channel: every request on it fails with
WorkerFailed (the gateway's retry rules then apply), and the next request opens a new one.
So does one that goes silent: a replica's channel sends at least an empty batch each
CHANNEL_HEARTBEAT_S, and a channel that hears nothing for `unresponsive_after_s` (a node lost or
cut off) fails at once rather than when Ray finds the node gone (tens of seconds, past most
requests' deadlines), so its whole requests run again elsewhere in time. `Channels` keeps each
replica's current channel: one that failed is opened again when asked about, and the replica
counts as reachable once that new channel hears from it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.cluster.pool import WorkerFailed
from worker.contract.calls import Delta, WorkerCall

log = logging.getLogger(__name__)
Batch = list[Delta]  # one engine step's deltas, of any of the channel's requests


def failure_of(e: BaseException) -> WorkerFailed:
    return e if isinstance(e, WorkerFailed) else WorkerFailed(f"{type(e).__name__}: {str(e)[:300]}")


class ReplicaChannel:
    def __init__(self, open_stream: Callable[[str], AsyncIterator[Batch]], start: Callable[[str, WorkerCall], Awaitable[Delta | None]],
                 cancel: Callable[[str, str], Any], unresponsive_after_s: float | None = None) -> None:
        self.id = uuid.uuid4().hex
        self._start, self._cancel = start, cancel
        self._unresponsive_after_s = unresponsive_after_s  # None: wait for the transport to fail
        self._queues: dict[str, asyncio.Queue[Delta | WorkerFailed]] = {}
        loop = asyncio.get_running_loop()
        self._opened: asyncio.Future[None] = loop.create_future()
        self._opened.add_done_callback(lambda f: f.exception())  # seen here even when no request waits on it
        self._ended: asyncio.Future[None] = loop.create_future()  # done when the channel fails
        self.failure: WorkerFailed | None = None
        self.is_draining = False  # the replica is being scaled down (`drain`)
        self._starting: dict[str, asyncio.Future[Delta | None]] = {}  # requests whose start the replica has not answered
        self._cancels: set[asyncio.Future[Any]] = set()  # cancels sent that the replica has not answered
        self._reader = asyncio.create_task(self._read(open_stream(self.id)))

    @property
    def is_live(self) -> bool:
        """The replica answered on this channel, which has not failed."""
        return self._opened.done() and self.failure is None

    async def _read(self, batches: AsyncIterator[Batch]) -> None:
        try:
            iterator = aiter(batches)
            while True:
                try:
                    async with asyncio.timeout(self._unresponsive_after_s):
                        batch = await anext(iterator)
                except StopAsyncIteration:
                    break
                if not self._opened.done():
                    self._opened.set_result(None)
                for delta in batch:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:  # else its caller has gone
                        queue.put_nowait(delta)
            self.fail(WorkerFailed("the replica closed the channel"))
        except TimeoutError:
            failure = WorkerFailed(f"the replica sent nothing for {self._unresponsive_after_s:g} s (its node lost or cut off?)")
            log.warning("channel %s: %s; %d requests on it fail over", self.id, failure, len(self._queues))
            self.fail(failure)
        except Exception as e:  # the replica died or could not be reached
            self.fail(failure_of(e))
        finally:
            cancel = getattr(batches, "cancel", None)
            if cancel is not None:
                cancel()

    def fail(self, failure: WorkerFailed) -> None:
        """End the channel: its requests fail, new ones go to a new channel."""
        if self.failure is not None:
            return
        self.failure = failure
        self._ended.set_result(None)
        if not self._opened.done():
            self._opened.set_exception(failure)
        for queue in self._queues.values():
            queue.put_nowait(failure)
        self._withdraw_cancels()
        if asyncio.current_task() is not self._reader:
            self._reader.cancel()

    def drain(self) -> None:
        """The replica is being scaled down: requests whose start it has not answered go elsewhere
        (WorkerFailed; Serve's router holds them, as the replica left it), those running end as
        they would, and then the channel closes, so that the replica has nothing left to wait for."""
        self.is_draining = True
        for starting in self._starting.values():
            starting.cancel()
        self._withdraw_cancels()
        if not self._queues:
            self.fail(WorkerFailed("the replica was scaled down"))

    async def _unless_failed(self, start: Awaitable[Delta | None], request_id: str) -> Delta | None:
        """`start`'s answer, or the channel's failure as soon as it fails (a replica that went silent
        would otherwise hold the caller until Ray gave up on it)."""
        task = self._starting[request_id] = asyncio.ensure_future(start)
        try:
            await asyncio.wait((task, self._ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._starting.pop(request_id, None)
            if not task.done():  # the channel failed, or the caller left
                task.cancel()
        if not task.done():
            raise self.failure
        if task.cancelled():  # `drain`
            raise WorkerFailed("the replica is being scaled down")
        e = task.exception()
        if e is not None:  # a restarted replica does not know the channel: a new one for the next request
            self.fail(failure_of(e))
            raise self.failure from e
        return task.result()

    def _send_cancel(self, request_id: str) -> None:
        """Cancel a request on the replica, kept until it is answered: Serve's router holds a call while
        the deployment has no running replica, and one left there would make Serve start it again."""
        sent = self._cancel(self.id, request_id)
        if inspect.isawaitable(sent):
            task = asyncio.ensure_future(sent)
            self._cancels.add(task)
            task.add_done_callback(self._cancel_answered)

    def _cancel_answered(self, task: asyncio.Future[Any]) -> None:
        self._cancels.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("channel %s: a cancel failed (%s)", self.id, type(task.exception()).__name__)

    def _withdraw_cancels(self) -> None:
        """The replica leaves (scaled down) or is gone: the cancels it has not taken cannot reach it;
        its channel's end ends their requests."""
        for task in list(self._cancels):
            task.cancel()

    async def stream(self, call: WorkerCall) -> AsyncIterator[Delta]:
        """`call`'s deltas, as the replica's `generate` would give them; WorkerFailed when the
        replica cannot be reached or dies."""
        await asyncio.shield(self._opened)
        queue: asyncio.Queue[Delta | WorkerFailed] = asyncio.Queue()
        self._queues[call.request_id] = queue
        finished = False
        try:
            if self.failure is not None:
                raise self.failure
            if self.is_draining:
                raise WorkerFailed("the replica is being scaled down")
            refusal = await self._unless_failed(self._start(self.id, call), call.request_id)
            if refusal is not None:
                finished = True
                yield refusal
                return
            while not finished:
                item = await queue.get()
                if isinstance(item, WorkerFailed):
                    raise item
                finished = item.is_finished
                yield item
        finally:
            del self._queues[call.request_id]
            if not finished and self.failure is None and not self.is_draining:  # the client left: free the worker's slot
                self._send_cancel(call.request_id)
            if self.is_draining and not self._queues:  # the last request on a replica scaled down
                self.fail(WorkerFailed("the replica was scaled down"))


class Channels:
    """Each replica's current channel (`open_channel(replica_id)` makes one), opened on first use
    and again, when asked for or about, after it failed."""

    def __init__(self, open_channel: Callable[[str], ReplicaChannel]) -> None:
        self._open = open_channel
        self._channels: dict[str, ReplicaChannel] = {}
        self._unheard: set[str] = set()  # their channel failed, and no new one has heard from them yet

    def get(self, replica_id: str) -> ReplicaChannel:
        channel = self._channels.get(replica_id)
        if channel is None or channel.failure is not None:
            if channel is not None:
                self._unheard.add(replica_id)
            channel = self._channels[replica_id] = self._open(replica_id)
        return channel

    def is_reachable(self, replica_id: str) -> bool:
        """Not known to be gone: its channel hears from it, or is opening for the first time. After
        a failure the replica is unreachable until a new channel (opened here) hears from it."""
        channel = self._channels.get(replica_id)
        if channel is None:
            return True
        if channel.failure is not None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # asked from outside the event loop: no new channel from here
                return False
            channel = self.get(replica_id)
        if channel.is_live:
            self._unheard.discard(replica_id)
            return True
        return replica_id not in self._unheard

    def drain(self, replica_id: str) -> None:
        """The replica is being scaled down (ReplicaChannel.drain); its next channel, if it comes back, is a new one."""
        channel = self._channels.get(replica_id)
        if channel is not None:
            channel.drain()

    def fail_all(self, failure: WorkerFailed) -> None:
        for channel in self._channels.values():
            channel.fail(failure)
