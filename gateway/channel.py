"""The gateway's end of a replica's channel (the replica's end is worker/shard/channel.py): one
stream from the replica carries the deltas of every request this gateway process runs there, one
batch per engine step, and is shared out to each request's own queue here (torch-free, Ray-free: the
transport is three callables).

A replica that dies or restarts ends the channel: every request on it fails with
WorkerFailed (the gateway's retry rules then apply), and the next request opens a new one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.pool import WorkerFailed
from worker.contract.calls import Delta, WorkerCall

Batch = list[Delta]  # one engine step's deltas, of any of the channel's requests


def failure_of(e: BaseException) -> WorkerFailed:
    return e if isinstance(e, WorkerFailed) else WorkerFailed(f"{type(e).__name__}: {str(e)[:300]}")


class ReplicaChannel:
    def __init__(self, open_stream: Callable[[str], AsyncIterator[Batch]], start: Callable[[str, WorkerCall], Awaitable[Delta | None]],
                 cancel: Callable[[str, str], Any]) -> None:
        self.id = uuid.uuid4().hex
        self._start, self._cancel = start, cancel
        self._queues: dict[str, asyncio.Queue[Delta | WorkerFailed]] = {}
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._opened.add_done_callback(lambda f: f.exception())  # seen here even when no request waits on it
        self.failure: WorkerFailed | None = None
        self._reader = asyncio.create_task(self._read(open_stream(self.id)))

    async def _read(self, batches: AsyncIterator[Batch]) -> None:
        try:
            async for batch in batches:
                if not self._opened.done():
                    self._opened.set_result(None)
                for delta in batch:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:  # else its caller has gone
                        queue.put_nowait(delta)
            self.fail(WorkerFailed("the replica closed the channel"))
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
        if not self._opened.done():
            self._opened.set_exception(failure)
        for queue in self._queues.values():
            queue.put_nowait(failure)
        if asyncio.current_task() is not self._reader:
            self._reader.cancel()

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
            try:
                refusal = await self._start(self.id, call)
            except Exception as e:  # a restarted replica does not know the channel: a new one for the next request
                self.fail(failure_of(e))
                raise self.failure from e
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
            if not finished and self.failure is None:  # the client left or the gateway gave up: free the worker's slot
                self._cancel(self.id, call.request_id)
