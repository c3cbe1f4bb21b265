"""A simulated worker: the engine's continuous batching (worker/engine/scheduler.py's rules)
on a linear cost model, in virtual time.

Each step decodes one token for every decoding sequence first; prompts then take what is left
of `max_step_tokens`, at most `prefill_while_decoding` beside decoding (the engine's
StepCosts, the production object, fed each step's simulated cost, raises that floor by
`decode_stall` as on a worker), scaled by the sequences waiting for their first token per
decoding one while every decoding sequence's tenant has one of those. Prompt tokens and free
KV slots go to the tenant served the fewest tokens first, then in arrival order (a tenant back
from idle starts level with the least served busy one), and once a second tenant has been seen
(or the engine is `is_multi_tenant`) a tenant already running may not take the last
`reserved_slots` free slots. More than `max_waiting` waiting: the replica refuses (503). Not
modelled: n > 1 choices, deadlines.

A run of steps that only decode, with nothing able to start, is one event (`steps` of the
same length): an arrival that could start cuts it at the step under way.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from bench.sim.contention import SharedCores
from bench.sim.profile import CostProfile
from bench.sim.workload import SimRequest
from worker.engine.step_costs import StepCosts

FF_OBSERVATIONS = 16  # a run of identical steps moves the moving averages at most this many times (then they have converged)


class Seq:
    __slots__ = ("request", "num_prompt", "num_cached", "num_computed", "num_generated", "arrived_s", "admitted_s",
                 "first_token_s", "finished_s", "arrival", "looked_up")

    def __init__(self, request: SimRequest, arrived_s: float) -> None:
        self.request = request
        self.num_prompt = request.num_prompt_tokens
        self.num_cached = self.num_computed = self.num_generated = 0
        self.arrived_s = arrived_s
        self.admitted_s = self.first_token_s = self.finished_s = -1.0
        self.arrival = 0  # its place in its replica's arrivals (the scheduler's tie-break)
        self.looked_up = False  # its cached prefix was found on arrival (num_cached), not to be looked up on admission

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt


class PrefixCache:
    """Which prefix chunks a replica finds: the shared tier (`shared`: a chunk computed anywhere
    is a hit everywhere) or a replica's own LRU of `l1_chunks` (alone, or beside the tier when the
    profile gives the tier's costs). A prefix is known by (tenant, the adapter whose KV it is,
    prefix): chunks hold KV, which depends on the adapters; a lookup finds at most the request's
    own prefix."""

    def __init__(self, chunk_tokens: int, shared: bool, l1_chunks: int) -> None:
        self.chunk_tokens, self.shared, self.l1_chunks = chunk_tokens, shared, l1_chunks
        self._chunks: OrderedDict[tuple[str, str, int], int] = OrderedDict()
        self._num_chunks = 0

    is_down = False  # the shared tier (Redis) unreachable: every lookup misses, nothing is stored

    def lookup(self, request: SimRequest) -> int:
        """Cached leading prompt tokens (whole chunks of its prefix)."""
        if request.prefix < 0 or self.is_down:
            return 0
        key = request.cache_key
        chunks = min(self._chunks.get(key, 0), request.num_prefix_tokens // self.chunk_tokens)
        if chunks and not self.shared:
            self._chunks.move_to_end(key)
        return chunks * self.chunk_tokens

    def store(self, request: SimRequest) -> None:
        if request.prefix < 0 or self.is_down:
            return
        key = request.cache_key
        chunks = request.num_stored_tokens // self.chunk_tokens
        old = self._chunks.get(key, 0)
        if chunks <= old:
            return
        self._chunks[key] = chunks
        self._num_chunks += chunks - old
        if not self.shared:
            self._chunks.move_to_end(key)
            while self._num_chunks > self.l1_chunks and self._chunks:
                _, dropped = self._chunks.popitem(last=False)
                self._num_chunks -= dropped


@dataclass
class StepStats:
    busy_s: float = 0.0  # stepping: passes and the loop around them
    pass_s: float = 0.0  # in passes alone
    profile_pass_s: float = 0.0  # what the profile says those passes take (less than pass_s: their cores were shared)
    slot_s: float = 0.0  # KV slots held, integrated over time (occupancy)
    num_steps: int = 0
    gaps: dict[int, int] = field(default_factory=dict)  # inter-token gaps: log bucket -> count


class ReplicaModel:
    def __init__(self, index: int, profile: CostProfile, cache: PrefixCache, pinned: frozenset[str],
                 shared: PrefixCache | None = None) -> None:
        """`cache`: what admission looks up and first tokens store to; `shared`: a tier beside it
        (its own L1 then), stored to as well."""
        self.index, self.profile, self.cache, self.pinned, self.shared = index, profile, cache, pinned, shared
        self.config = profile.engine
        self.costs = StepCosts()  # the engine's own: measured costs raise the prompt budget beside decoding
        self.running: list[Seq] = []
        self.queues: dict[str, deque[Seq]] = {}  # waiting, per tenant in arrival order
        self.num_waiting = 0
        self._num_arrivals = 0
        self._served: dict[str, int] = {}  # tokens computed per tenant (the scheduler's least attained service)
        self._floor = 0
        self._running_tenants: dict[str, int] = {}  # sequences running per tenant
        # adapters beyond the pins, least recently used first; with tiers (profile.device_adapters), every adapter on
        # the device, those it serves (its pins; some of them from the start) among them
        self.is_tiered = profile.device_adapters is not None
        self.capacity = profile.device_adapters if self.is_tiered else profile.max_loaded_adapters
        self.loaded: OrderedDict[str, None] = OrderedDict.fromkeys(list(pinned)[: self.capacity] if self.is_tiered else ())
        # with a host budget: the adapters in host memory, least recently used first (the device's among them)
        self.host_capacity = profile.host_adapters
        self.host: OrderedDict[str, None] = OrderedDict.fromkeys(self.loaded)
        self.lower_loads = 0  # loads from disk or the store (not on the host)
        self.num_loading = 0  # requests waiting for an adapter to load here
        self.num_evictions = 0  # adapters it dropped for room
        self.in_flight = 0  # the gateway's view: running, waiting and loading (kept as they change: read per request)
        self.is_down = False  # lost (a fault), until it restarts
        # a list: each first token's (time, TTFT) appended (bench/sim/scaling.py reads it)
        self.ttft_log: list[tuple[float, float]] | None = None
        self.epoch = 0  # restarts: a load begun before one never completes
        self.stats = StepStats()
        self.version = 0  # of the step under way: a cut one's end event is stale
        self.step_start_s = self.step_s = self.pass_s = self.profile_pass_s = 0.0  # a step: its pass and the loop around it
        self.contention: SharedCores | None = None  # the machine's cores, shared with other replicas and the serving path
        self.num_steps = 0  # steps of the run under way (0: idle)
        self._spans: list[tuple[Seq, int]] = []
        self._num_decode = self._num_prompt_tokens = 0

    # the gateway's view

    def loading(self, change: int) -> None:
        """A request began (1) or ended (-1) waiting for its adapter to load here."""
        self.num_loading += change
        self.in_flight += change

    @property
    def is_idle(self) -> bool:
        return self.num_steps == 0

    def lose(self) -> list[Seq]:
        """The replica is gone: every sequence it had (running or waiting); it takes none until `restart`."""
        lost = [*self.running, *(seq for queue in self.queues.values() for seq in queue)]
        self.running, self.queues, self.num_waiting, self._running_tenants = [], {}, 0, {}
        self._served, self._floor = {}, 0
        self.is_down, self.num_steps, self.num_loading, self.in_flight, self._spans = True, 0, 0, 0, []
        self.version += 1  # its step under way never ends
        self.epoch += 1  # loads under way for it never arrive
        return lost

    def restart(self) -> None:
        """Back, empty: what a new process holds (its device tier: some of its pins again)."""
        self.is_down = False
        if not self.cache.shared:  # its own L1 went with the process
            self.cache = PrefixCache(self.cache.chunk_tokens, False, self.cache.l1_chunks)
        self.loaded = OrderedDict.fromkeys(list(self.pinned)[: self.capacity] if self.is_tiered else ())
        self.host = OrderedDict.fromkeys(self.loaded)
        self.costs = StepCosts()

    def holds(self, adapter: str) -> bool:
        """Whether a request for `adapter` runs here without loading it first."""
        return adapter in self.loaded or adapter == "base" or (not self.is_tiered and adapter in self.pinned)

    def load_s(self, adapter: str) -> float:
        """How long bringing `adapter` onto the device takes: from host memory, or from below it."""
        if self.host_capacity is None or adapter in self.host:
            return self.profile.adapter_load_s
        return self.profile.adapter_load_lower_s

    def load(self, adapter: str) -> None:
        """Hold `adapter` (loaded, or used: most recently), evicting the least recently used past the capacity."""
        if adapter == "base" or (not self.is_tiered and adapter in self.pinned):
            return
        self.loaded[adapter] = None
        self.loaded.move_to_end(adapter)
        while len(self.loaded) > self.capacity:
            self.loaded.popitem(last=False)
            self.num_evictions += 1
        if self.host_capacity is not None:  # inclusive: what is on the device is on the host too
            if adapter not in self.host:
                self.lower_loads += 1
            self.host[adapter] = None
            self.host.move_to_end(adapter)
            while len(self.host) > self.host_capacity:
                dropped = next(iter(self.host))
                if dropped in self.loaded:  # the device's stay (LRU there is the same order)
                    self.host.move_to_end(dropped)
                    continue
                del self.host[dropped]

    # requests

    def offer(self, seq: Seq) -> bool:
        """Queue it, or False (503: its queue is full)."""
        if self.num_waiting >= self.config.max_waiting:
            return False
        tenant = seq.request.tenant
        if tenant not in self.queues and tenant not in self._running_tenants:  # back from idle: level with the rest
            self._served[tenant] = self._floor
        seq.arrival, self._num_arrivals = self._num_arrivals, self._num_arrivals + 1
        self.queues.setdefault(tenant, deque()).append(seq)
        self.num_waiting += 1
        self.in_flight += 1
        return True

    def cut(self, now_s: float) -> float | None:
        """A request arrived: a run of decode steps ends with the step under way, if a slot is
        free for it to start in the next. The new end, or None when nothing changes."""
        if self.num_steps <= 1 or len(self.running) >= self.config.num_seq_slots:
            return None
        done = int((now_s - self.step_start_s) / self.step_s)
        if done + 1 >= self.num_steps:
            return None
        self.num_steps = done + 1
        self.version += 1
        return self.step_start_s + self.num_steps * self.step_s

    # steps

    def start(self, now_s: float) -> float | None:
        """Plan the next step (or run of identical decode steps) from `now_s`: its end, None when idle."""
        decoding = [seq for seq in self.running if not seq.is_prefilling]
        prefilling = [seq for seq in self.running if seq.is_prefilling]
        spans = [(seq, 1) for seq in decoding]
        for seq in decoding:
            self._served[seq.request.tenant] += 1
        free = self.config.num_seq_slots - len(self.running)
        budget = self._prompt_budget(decoding, prefilling, free)
        num_prompt_tokens, free = self._take_prompts(now_s, budget, prefilling, free, spans)
        self._level()
        if not spans:
            self.num_steps = 0
            return None
        self._spans, self._num_decode, self._num_prompt_tokens = spans, len(decoding), num_prompt_tokens
        num_firsts = sum(1 for seq, length in spans if seq.is_prefilling and seq.num_computed + length == seq.num_prompt)
        num_steps = 1
        if num_prompt_tokens == 0 and not (free and any(self._may_take_slot(t, free) for t in self.queues)):
            # nothing can start until one finishes
            num_steps = min(seq.request.max_tokens - seq.num_generated for seq in decoding)
        # the decoding sequences' longest context (its new token's included); over a run, its mean (a token longer each
        # step: the run's time is exact, each of its steps the mean; one cut short keeps that mean)
        context = max((seq.num_computed + 1 for seq in decoding), default=0) + (num_steps - 1) / 2
        self.profile_pass_s = self.profile.step_s(num_prompt_tokens, len(decoding), context)
        self.pass_s = self.profile_pass_s * (self.contention.factor(now_s, self.index) if self.contention is not None else 1.0)
        self.step_s = self.pass_s + self.profile.loop_s(len(decoding) + num_firsts)
        self.step_start_s, self.num_steps = now_s, num_steps  # stepping from now (after the cores were shared out without it)
        self.version += 1
        return now_s + self.num_steps * self.step_s

    def _prompt_budget(self, decoding: list[Seq], prefilling: list[Seq], free: int) -> int:
        """Prompt tokens the step may take beside `decoding`: what `max_step_tokens` leaves, at most the
        engine's floor beside decoding, scaled by the sequences starting per decoding one while every
        decoding sequence's tenant has one of those."""
        config = self.config
        budget = config.max_step_tokens - len(decoding)
        prompt_floor = self.costs.prompt_budget(config.prefill_while_decoding, config.decode_stall)
        if decoding and prompt_floor is not None:
            starting_tenants = {seq.request.tenant for seq in prefilling} | (self.queues.keys() if free else set())
            if any(seq.request.tenant not in starting_tenants for seq in decoding):
                budget = min(budget, prompt_floor)  # another tenant's streams: the bound, no more
            else:
                starting = len(prefilling) + min(self.num_waiting, free)
                budget = min(budget, int(prompt_floor * max(1.0, starting / len(decoding))))
        return budget

    def _take_prompts(self, now_s: float, budget: int, prefilling: list[Seq], free: int,
                      spans: list[tuple[Seq, int]]) -> tuple[int, int]:
        """Prompt tokens up to `budget`, fairly between tenants, appended to `spans` (`prefilling`
        loses those it continues): (prompt tokens taken, KV slots still free)."""
        served = self._served
        num_prompt_tokens = 0
        while budget > 0:
            best = self._next_prompt(prefilling, free)
            if best is None:
                break
            tenant = best.request.tenant
            if best.admitted_s < 0:
                self._admit(best, now_s)
                free -= 1
            else:
                prefilling.remove(best)
            length = min(best.num_prompt - best.num_computed, budget)
            spans.append((best, length))
            budget -= length
            served[tenant] += length
            num_prompt_tokens += length
        return num_prompt_tokens, free

    def _next_prompt(self, prefilling: list[Seq], free: int) -> Seq | None:
        """The sequence whose prompt goes next: of the running ones and each tenant's first waiting
        one (if it may take a slot), the least served tenant's, then the earliest to arrive."""
        served = self._served
        best, best_turn = None, None
        for seq in prefilling:
            turn = (served[seq.request.tenant], seq.arrival)
            if best_turn is None or turn < best_turn:
                best, best_turn = seq, turn
        for tenant, queue in self.queues.items():
            turn = (served[tenant], queue[0].arrival)
            if (best_turn is None or turn < best_turn) and self._may_take_slot(tenant, free):
                best, best_turn = queue[0], turn
        return best

    def _admit(self, seq: Seq, now_s: float) -> None:
        """`seq` leaves its tenant's queue for a KV slot, its cached prefix looked up unless it was on arrival."""
        tenant = seq.request.tenant
        queue = self.queues[tenant]
        queue.popleft()
        if not queue:
            del self.queues[tenant]
        self.num_waiting -= 1
        seq.admitted_s = now_s
        if not seq.looked_up:
            seq.num_cached = min(self.cache.lookup(seq.request), seq.num_prompt - 1)
        seq.num_computed = seq.num_cached
        self.running.append(seq)
        self._running_tenants[tenant] = self._running_tenants.get(tenant, 0) + 1

    def _may_take_slot(self, tenant: str, free: int) -> bool:
        """Whether `tenant`'s next waiting request may take one of the `free` KV slots (the scheduler's reserve)."""
        if free < 1:
            return False
        is_multi = self.config.is_multi_tenant or len(self._served) > 1
        reserve = min(self.config.reserved_slots, self.config.num_seq_slots - 1) if is_multi else 0
        return free - 1 >= reserve or tenant not in self._running_tenants

    def _level(self) -> None:
        """The scheduler's floor: the least any tenant with work has been served."""
        active = self._running_tenants.keys() | self.queues.keys()
        if active:
            self._floor = max(self._floor, min(self._served[t] for t in active))

    def finish_steps(self, now_s: float) -> list[Seq]:
        """The step (or run) under way has ended at `now_s`: the sequences it finished."""
        steps, step_s = self.num_steps, self.step_s
        self.stats.busy_s += steps * step_s
        self.stats.pass_s += steps * self.pass_s
        self.stats.profile_pass_s += steps * self.profile_pass_s
        self.stats.slot_s += steps * step_s * len(self.running)
        self.stats.num_steps += steps
        for _ in range(min(steps, FF_OBSERVATIONS)):
            self.costs.observe(self._num_decode, self._num_prompt_tokens, self.pass_s)  # the engine times its passes alone
        if self._num_decode:
            bucket = round(step_s * 1e4)  # 0.1 ms
            self.stats.gaps[bucket] = self.stats.gaps.get(bucket, 0) + steps * self._num_decode
        if steps > 1:  # a run: its decoding sequences' tenants served a token a step after the first
            for seq in self.running:
                if not seq.is_prefilling:
                    self._served[seq.request.tenant] += steps - 1
            self._level()
        done: list[Seq] = []
        for seq, length in self._spans:
            if length == 1 and not seq.is_prefilling:
                seq.num_computed += steps
                seq.num_generated += steps
            else:
                seq.num_computed += length
                if seq.num_computed == seq.num_prompt:  # its last prompt token: the first new token
                    seq.num_generated = 1
                    seq.first_token_s = now_s
                    if self.ttft_log is not None:
                        self.ttft_log.append((now_s, now_s - seq.request.at_s))
                    self.cache.store(seq.request)
                    if self.shared is not None:
                        self.shared.store(seq.request)
            if seq.num_generated >= seq.request.max_tokens:
                seq.finished_s = now_s
                done.append(seq)
        if done:
            finished = set(map(id, done))
            self.in_flight -= len(done)
            for seq in done:
                tenant = seq.request.tenant
                self._running_tenants[tenant] -= 1
                if not self._running_tenants[tenant]:
                    del self._running_tenants[tenant]
            self.running = [seq for seq in self.running if id(seq) not in finished]
        self._spans = []
        self.num_steps = 0
        return done
