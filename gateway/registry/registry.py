"""The adapter registry as one gateway replica sees it (torch-free): which adapters each
tenant may use by name, which fingerprints each worker pins, and the changes tenants make.

- Names are per tenant (owner); what a tenant sees, its own and the shared ones its policy
  allows, checked by content too, is gateway/registry/visibility.py's.
- A change is staged, made servable, then committed. An added or replacing adapter is
  first recorded as pending: it is pinned (workers load it) while its name still points
  where it did. Once a replica holds it the name moves to it in one transaction; if none
  can, the change is dropped and nothing else moved. A replaced or removed version is
  unpinned: workers drop it once the requests on it have finished, and its file goes
  once no worker holds it.
- Files are kept in the adapter store (cache/blobs.py: S3, a shared directory, or this
  machine's) by fingerprint; an upload is stored before any record names it, and a worker
  is sent fingerprints only: it fetches each new one from the store into its own node's
  cache. A worker that cannot fetch or load one reports it failed, and the name does not move.
- Every gateway polls the version and, on a change, first pushes the new pins to the
  workers (they are idempotent and versioned) and learns what they hold, and only then
  lets requests see the new names: no request is routed to a worker before it holds
  what the request needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cache.blobs import BlobStore, BlobStoreError, open_blob_store
from gateway.catalog import AdapterInfo, Catalog
from gateway.cluster.pool import NotServing, ReplicaInfo, ShardPool
from gateway.config import ServeConfig
from gateway.errors import GatewayError
from gateway.policy.placement import PlacementError
from gateway.policy.routing import Residents
from gateway.registry.garbage import StoredFiles
from gateway.registry.limits import check_limits, describe
from gateway.registry.live_placement import LivePlacement, Phase
from gateway.registry.records import (
    PENDING,
    SHARED,
    AdapterRecord,
    FileRecords,
    Records,
    RecordStore,
    RedisRecords,
    RegistryUnavailable,
    SharedReads,
    record_key,
)
from gateway.registry.visibility import Caller, forbidden, visible
from worker.contract.identity import Fingerprint
from worker.formats.adapter import LoRAAdapter

log = logging.getLogger(__name__)
Pins = frozenset[Fingerprint]  # what a worker should hold (it has the config's adapters; the others it fetches from the store)
Sync = Callable[[str, int, list[Fingerprint]], Awaitable[dict[str, Any]]]
Wake = Callable[[list[str]], float | None]  # replicas of a shard asleep to start; how long a start may take (the pool's)


class AdapterRegistry:
    def __init__(self, config: ServeConfig, catalog: Catalog, records: RecordStore, store: BlobStore,
                 replicas: list[ReplicaInfo], sync: Sync | None = None,
                 clock: Callable[[], float] = time.monotonic, phase: Phase | None = None,
                 wake: Wake | None = None) -> None:
        self.config, self.catalog, self.records, self.store = config, catalog, records, store
        self.settings = config.registry
        self.replicas = replicas
        self.sync, self.wake = sync, wake
        self.placement = LivePlacement(config, replicas, phase)  # over the replicas each shard has now
        self._clock = clock
        self.seed = dict(catalog.adapters)  # the config's adapters, shared: the registry's seed
        self.seed_pins: dict[str, Pins] = {  # shard -> its config adapters
            s.name: frozenset(Fingerprint(catalog.adapters[n].fingerprint) for n in s.adapters) for s in config.shards
        }
        self.version, self.current = -1, {}
        self.held: dict[str, frozenset[Fingerprint]] = {  # what each worker takes requests for
            r.replica_id: frozenset(self.seed_pins[r.shard]) for r in replicas
        }
        self.resident: dict[str, frozenset[Fingerprint]] = dict(self.held)  # held or draining: files still in use
        self.failed: dict[str, dict[Fingerprint, str]] = {}  # replica -> the adapters it could not load, and why
        self.files = StoredFiles(store, self.settings.garbage_age_s)  # what collect_garbage deletes
        self.tiers: dict[str, Residents] = {}  # replica -> where it has its adapters (workers with tiers)
        self._visible: dict[tuple[str, frozenset[str] | None], dict[str, AdapterInfo]] = {}  # by tenant and its ACL
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._reads = SharedReads(self.refresh, clock)  # the version checks requests wait on
        self.traffic: dict[Fingerprint, float] = {}  # requests lately (decayed at each re-plan)
        self.asked: set[Fingerprint] = set()  # adapters requested since the last re-plan
        self._replanned_s = clock()

    # what requests see

    def visible(self, tenant: Caller) -> dict[str, AdapterInfo]:
        """The adapters `tenant` may use, by its names (gateway/registry/visibility.py), kept per tenant
        and policy until the records change."""
        cached = self._visible.get((tenant.id, tenant.allowed))  # an operator may change a tenant's ACL
        if cached is None:
            cached = self._visible[(tenant.id, tenant.allowed)] = visible(tenant, self.seed, self.current, self.info)
        return cached

    def info(self, r: AdapterRecord) -> AdapterInfo:
        return AdapterInfo(r.name, self.store.path(r.fingerprint), r.fingerprint, r.task_name, r.prompt_prefix,
                           r.invocation_tokens, r.owner, r.is_dora, r.chat_template)

    def owned(self, owner: str | None) -> list[AdapterRecord]:
        """Committed records of `owner` (None: everyone's)."""
        committed = (r for k, r in self.current.items() if not k.startswith(PENDING) and owner in (None, r.owner))
        return sorted(committed, key=lambda r: (r.owner, r.created_s, r.name))

    def pins(self, shard: str, records: Records | None = None) -> Pins:
        """What `shard`'s workers should hold: its config adapters and the records (default: the
        current ones) placed on it."""
        records = self.current if records is None else records
        placed = (Fingerprint(r.fingerprint) for r in records.values() if shard in r.shards)
        return self.seed_pins.get(shard, frozenset()) | frozenset(placed)

    def health(self) -> dict[str, Any]:
        pending = sum(k.startswith(PENDING) for k in self.current)
        return {"version": self.version, "registered": len(self.current) - pending, "pending": pending,
                "config": len(self.seed), "failed_loads": {rid: len(f) for rid, f in self.failed.items() if f}}

    def is_held(self, fingerprint: Fingerprint, shards: tuple[str, ...]) -> bool:
        return any(fingerprint in self.held[r.replica_id] for r in self.replicas if r.shard in shards)

    def count(self, fingerprints: Iterable[Fingerprint]) -> None:
        """A request routed for these adapters (a `ScalesByFingerprint` will do): the re-plan's traffic."""
        for fingerprint in fingerprints:
            self.traffic[fingerprint] = self.traffic.get(fingerprint, 0.0) + 1.0
            self.asked.add(fingerprint)

    async def replan(self) -> dict[Fingerprint, tuple[str, ...]]:
        """Move registered adapters' pins with the traffic this gateway saw (one gateway at a time,
        under a lease): hot ones get another shard, cold ones give extra copies back."""
        if not await self.records.lease("replan", self.settings.replan_interval_s):
            return {}
        placed: dict[Fingerprint, tuple[str, ...]] = {}
        for r in self.current.values():
            placed[r.fingerprint] = tuple(sorted(set(placed.get(r.fingerprint, ())) | set(r.shards)))
        changes = self.placement.moves(placed, self.traffic, {s: len(pins) for s, pins in self.seed_pins.items()}, self.asked)
        self.traffic = {fp: n / 2 for fp, n in self.traffic.items() if n >= 1.0}
        self.asked = set()
        if not changes:
            return {}

        def move(records: Records):
            return {k: replace(r, shards=changes[r.fingerprint])
                    for k, r in records.items() if r.fingerprint in changes}, None

        await self.records.transact(move)
        await self.refresh(force=True)
        log.info("re-planned %d adapter(s): %s", len(changes), {fp[:12]: s for fp, s in changes.items()})
        return changes

    # keeping up with the other gateways

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        last_push_s = self._clock()
        while True:
            try:
                if await self.refresh():
                    last_push_s = self._clock()
                elif self._clock() - last_push_s > self.settings.resync_interval_s:
                    await self.push()  # a restarted worker gets its pins back
                    await self.collect_garbage()
                    last_push_s = self._clock()
                if self._clock() - self._replanned_s > self.settings.replan_interval_s:
                    self._replanned_s = self._clock()
                    await self.replan()
            except RegistryUnavailable as e:
                log.warning("%s; serving what is known", e)
            except Exception:
                log.exception("registry refresh failed")
            await asyncio.sleep(self.settings.poll_interval_s)

    async def refresh_if_stale(self) -> None:
        """A request's path: what it sees is no older than its arrival (a change made through
        another gateway replica just before is seen; SharedReads: requests that come together share
        one version check, Redis being down changes nothing)."""
        await self._reads.since(self._clock())

    async def refresh(self, force: bool = False) -> bool:
        """Take the stored records when they changed: pins pushed first, names after."""
        async with self._lock:
            version = await self.records.version()
            if version == self.version and not force:
                return False
            version, records = await self.records.load()
            await self.push(version, records)
            self.version, self.current = version, records
            self._visible.clear()
            return True

    async def push(self, version: int | None = None, records: Records | None = None,
                   replicas: list[ReplicaInfo] | None = None) -> None:
        """Send every worker its pins for `records` and learn what it holds."""
        version = self.version if version is None else version
        wanted = {r.replica_id: self.pins(r.shard, records) for r in replicas or self.replicas}
        await asyncio.gather(*(self._push_one(rid, version, pins) for rid, pins in wanted.items()))

    async def push_to(self, replica_id: str) -> None:
        """Give a replica that has just come up (an autoscaled shard's) its pins before any request is
        routed to it; raise when it did not take them."""
        shard = next(r.shard for r in self.replicas if r.replica_id == replica_id)
        await self._sync_one(replica_id, self.version, self.pins(shard))

    async def _push_one(self, replica_id: str, version: int, pins: Pins) -> None:
        try:
            await self._sync_one(replica_id, version, pins)
        except NotServing as e:  # an autoscaled shard's replica not serving now: it gets its pins when it comes up
            log.debug("replica %s not synced: %s", replica_id, e)
        except Exception as e:  # noqa: BLE001 - whatever the transport raises
            # a dead or slow worker keeps its last known set; the health check marks it down
            log.warning("replica %s did not take its pins (%s)", replica_id, type(e).__name__)

    async def _sync_one(self, replica_id: str, version: int, pins: Pins) -> None:
        """Send one worker its pins and learn what it holds; raises what the transport raises."""
        if self.sync is None:  # workers without pins to change (tests' fakes): they hold what they are given
            self.held[replica_id] = self.resident[replica_id] = frozenset(pins)
            return
        reply = await asyncio.wait_for(self.sync(replica_id, version, sorted(pins)), self.settings.load_timeout_s)
        if reply.get("version", version) > version:
            return  # it has newer pins from another gateway; this gateway will see them at its next refresh
        self.held[replica_id] = frozenset(reply.get("held", ()))
        self.resident[replica_id] = self.held[replica_id] | frozenset(reply.get("draining", ()))
        self.failed[replica_id] = dict(reply.get("failed", {}))
        tiers = reply.get("tiers")
        if tiers is None:
            self.tiers.pop(replica_id, None)
        else:
            self.tiers[replica_id] = Residents(tiers)

    def promoted(self, replica_id: str, fingerprints: Iterable[Fingerprint]) -> None:
        """A request for `fingerprints` was sent to `replica_id` (a worker with tiers has them on its device now)."""
        tiers = self.tiers.get(replica_id)
        if tiers is not None:
            tiers.promoted(fingerprints)

    async def collect_garbage(self) -> None:
        """Delete from the store the adapter files no record pins and no worker still holds (gateway/registry/garbage.py)."""
        kept = {r.fingerprint for r in self.current.values()}
        kept.update(fp for pins in self.seed_pins.values() for fp in pins)
        await self.files.collect(kept.union(*self.resident.values()))

    # changes

    def _taken(self, name: str, shared_names: frozenset[str]) -> None:
        if name == self.catalog.model_name:
            raise GatewayError(409, f"{name!r} is the base model's name", "name_taken")
        if name in shared_names:
            raise GatewayError(409, f"the name {name!r} is taken by a shared adapter this key uses", "name_taken")

    async def register(self, owner: str, name: str, adapter: LoRAAdapter, staged: Path, limits: tuple[int, int] | None,
                       replace_existing: bool = True,
                       tenant: Caller | None = None) -> tuple[AdapterRecord, AdapterRecord | None, float]:
        """`_register`, with the adapter's file kept from this gateway's garbage collection while it is
        staged (stored, and no record names it yet)."""
        async with self.files.staging(adapter.fingerprint):
            return await self._register(owner, name, adapter, staged, limits, replace_existing, tenant)

    async def _register(self, owner: str, name: str, adapter: LoRAAdapter, staged: Path, limits: tuple[int, int] | None,
                        replace_existing: bool, tenant: Caller | None) -> tuple[AdapterRecord, AdapterRecord | None, float]:
        """Add or replace `owner`'s `name` with the checked adapter in `staged`; (the record, the
        one it replaced, seconds until it was servable). A tenant's name may not hide a shared
        adapter it uses (one it cannot see, it may), and a tenant may not register the content of
        a shared adapter its ACL leaves out. Raises GatewayError for a refusal."""
        started_s = self._clock()
        if owner == SHARED and name in self.seed:
            raise GatewayError(409, f"adapter {name!r} is defined in the deployment config; change it there",
                           "config_adapter")
        if tenant is not None and adapter.fingerprint in forbidden(tenant, self.seed, self.current):
            raise GatewayError(403, "this adapter is a shared adapter this key may not use (the same content under another "
                           "name is refused too)", "adapter_not_allowed")
        await self._store(staged, adapter.fingerprint)  # the file before any record names it
        fresh = describe(adapter, owner, name, staged.stat().st_size)
        key, pending_key = record_key(owner, name), PENDING + record_key(owner, name)

        shared = frozenset(
            () if tenant is None else (n for n, info in self.visible(tenant).items() if info.owner == SHARED))

        def stage(records: Records):
            self._taken(name, shared)
            old = records.get(key)
            if old is not None and not replace_existing:
                raise GatewayError(400, f"The lora adapter '{name}' has already been loaded.", "adapter_exists")
            if limits is not None and owner != SHARED:
                check_limits(records, fresh, limits)
            return {pending_key: replace(fresh, shards=self._place(fresh.fingerprint, old, records))}, old

        await self.records.transact(stage)
        await self.refresh(force=True)
        await self._until_loaded(fresh.fingerprint, self.current.get(pending_key, fresh).shards)

        def commit(records: Records):
            staged_record = records.get(pending_key)
            if staged_record is None or staged_record.fingerprint != fresh.fingerprint:
                raise GatewayError(409, f"adapter {name!r} was changed by another request meanwhile", "conflict")
            if not self.is_held(fresh.fingerprint, staged_record.shards):
                return {pending_key: None}, (None, None)
            return {pending_key: None, key: staged_record}, (staged_record, records.get(key))

        _, (committed, replaced) = await self.records.transact(commit)
        await self.refresh(force=True)
        if committed is None:
            reasons = {why for failed in self.failed.values() for fp, why in failed.items() if fp == fresh.fingerprint}
            raise GatewayError(503, "no worker could load the adapter" + (f": {min(reasons)}" if reasons else " in time"),
                           "adapter_not_loaded", {"Retry-After": "5"})
        return committed, replaced, self._clock() - started_s

    async def _until_loaded(self, fingerprint: Fingerprint, shards: Iterable[str]) -> None:
        """Until the workers of `shards` hold the adapter, every one of them failed to load it (a failed
        load is final), or `load_timeout_s` passed. The registry's push already waited for the loads;
        this is for workers that did not answer in time, and for shards all asleep: they are woken,
        and the wait is longer by their start."""
        shards = tuple(shards)
        targets = [r for r in self.replicas if r.shard in shards]
        timeout_s = self.settings.load_timeout_s
        if self.wake is not None and not any(self.placement.is_up(r.replica_id) for r in targets):
            timeout_s += self.wake([r.replica_id for r in targets]) or 0.0  # its shards asleep: their start first
        deadline_s = self._clock() + timeout_s
        while (not self.is_held(fingerprint, shards) and self._clock() < deadline_s
               and not all(fingerprint in self.failed.get(r.replica_id, {}) for r in targets)):
            await asyncio.sleep(0.25)
            await self.push(replicas=targets)

    async def _store(self, staged: Path, fingerprint: Fingerprint) -> None:
        """`staged` in the adapter store, or a 503 that says so (what failed is in the log, not the answer)."""
        try:
            await asyncio.to_thread(self.store.put, staged, fingerprint)
        except BlobStoreError as e:
            log.warning("adapter %s could not be stored in %s: %s", fingerprint[:16], self.store.url, e)
            raise GatewayError(503, "the adapter store could not keep the file; nothing was changed", "adapter_store_unavailable",
                           {"Retry-After": "5"}) from e

    def _place(self, fingerprint: Fingerprint, old: AdapterRecord | None, records: Records) -> tuple[str, ...]:
        """Shards for a new pin: where the same content already is, else where the old version
        was, else the planner's choice among shards with room."""
        for r in records.values():
            if r.fingerprint == fingerprint and r.shards:
                return r.shards
        seeded = tuple(s for s, pins in self.seed_pins.items() if fingerprint in pins)
        if seeded:
            return seeded
        if old is not None and old.shards:
            return old.shards
        pinned = {s.name: len(self.pins(s.name, records)) for s in self.config.shards}
        try:
            return self.placement.for_new(pinned)
        except PlacementError as e:
            raise GatewayError(507, str(e), "no_worker_room") from e

    async def unregister(self, owner: str, name: str) -> AdapterRecord:
        if owner == SHARED and name in self.seed:
            raise GatewayError(409, f"adapter {name!r} is defined in the deployment config; change it there",
                           "config_adapter")
        key = record_key(owner, name)

        def drop(records: Records):
            old = records.get(key)
            if old is None:
                raise GatewayError(404, f"adapter {name!r} not found", "adapter_not_found")
            return {key: None}, old

        _, old = await self.records.transact(drop)
        await self.refresh(force=True)
        return old


def open_registry(config: ServeConfig, catalog: Catalog, pool: ShardPool,
                  clock: Callable[[], float] = time.monotonic) -> AdapterRegistry:
    """The deployment's registry over `pool`'s workers: its records in Redis when the deployment
    has one, else in a file in the store's local directory; records are per base model (adapters
    fit only it). Files go to the adapter store the config names (cache/blobs.py)."""
    store = open_blob_store(config.blob_store())
    scope = catalog.base_fingerprint[:16]
    redis_config = config.state_redis()
    if redis_config is not None:
        from cache.l2 import connect

        records: RecordStore = RedisRecords(connect(redis_config, is_async=True), f"{redis_config.key_prefix}:{scope}:",
                                            ack_timeout_s=redis_config.replica_ack_timeout_s)
    else:
        records = FileRecords(store.directory, scope)
    return AdapterRegistry(config, catalog, records, store, pool.replicas, getattr(pool, "sync", None), clock,
                           getattr(pool, "phase", None), getattr(pool, "wake", None))


