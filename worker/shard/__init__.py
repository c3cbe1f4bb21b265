"""One replica of a shard, the worker side of the wire contract (worker/contract/calls.py):
`worker` (the `ShardWorker`: built from a `WorkerSpec`, `WorkerCall`s in, `Delta`s out),
`channel` (its end of each caller's channel, and the mailbox from the engine's thread),
`metrics` (what it adds to `/metrics` and `/health`)."""

from worker.shard.worker import ShardWorker

__all__ = ["ShardWorker"]
