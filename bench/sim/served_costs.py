"""The serving path's costs, measured on a real `loraplex serve` before `bench.sim.validate`'s measured run
and made terms of a simulation profile (`under_load`): how much slower its passes ran under load than the bare
engine's calibrated profile predicts, the engine loop's time around each pass and each delta it hands out, a
request's way to its worker and back, and its prefix lookup. Each from counters the server exports on /metrics,
read before and after a load (`Counter`s of their differences); pure functions of them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from bench.sim.profile import CostProfile


@dataclass(frozen=True)
class Measured:
    """What the real server measured before the measured run, that the profiles under load are made of."""

    warm_up: Counter  # the replicas' and the gateway's counters over the warm-up's load (another seed's requests)
    lone: Counter  # the same over requests sent one at a time
    ttft_s: float = 0.0  # the load tester's TTFTs over the warm-up, summed
    num_ttfts: int = 0
    num_sent: int = 0  # requests the load tester sent over the warm-up
    busy_cpu_s: float = 0.0  # over the warm-up: the machine's busy CPU
    replicas_cpu_s: float = 0.0  # over the warm-up: the replicas' processes' CPU (their passes' threads' included)
    cores: int = 0  # the machine's
    chunk_tokens: int | None = None  # the prefix cache's chunk (None: no Redis tier)
    life_s: float = 0.0  # the warm-up's answered requests' mean time from sending to their last token (0: not measured)


def pass_ratio(profile: CostProfile, passes: Counter) -> float | None:
    """The served replicas' time in their passes over what `profile` predicts for the same passes
    (their count, prompt tokens and generated tokens, each of those a sequence decoding in some pass; the counters
    do not say the decoding sequences' contexts, so their cost, `decode_context_s`, is left out of the prediction)."""
    predicted = (passes["loraplex_engine_steps_total"] * profile.step_overhead_s
                 + passes["loraplex_engine_prompt_tokens_total"] * profile.prompt_token_s
                 + passes["loraplex_engine_generated_tokens_total"] * profile.decode_seq_s)
    return passes["loraplex_engine_step_seconds_sum"] / predicted if predicted > 0 else None


def loop_terms(warm_up: Counter, lone: Counter) -> tuple[float, float]:
    """The engine loop's time beyond its passes (`loraplex_engine_loop_seconds_total` less the passes'), as a part per
    pass and a part per delta: solved from two loads, one request at a time (a delta a pass) and the warm-up's (many);
    where those two do not give two parts >= 0, all of it per delta, from the warm-up. (0, 0): nothing measured."""
    def point(passes: Counter) -> tuple[float, float, float]:
        outside_s = passes["loraplex_engine_loop_seconds_total"] - passes["loraplex_engine_step_seconds_sum"]
        return passes["loraplex_engine_steps_total"], passes["loraplex_engine_loop_deltas_total"], max(0.0, outside_s)

    (lone_steps, lone_deltas, lone_s), (steps, deltas, outside_s) = point(lone), point(warm_up)
    if not steps or not deltas:
        return 0.0, 0.0
    det = lone_steps * deltas - steps * lone_deltas
    if det:
        per_pass, per_delta = (lone_s * deltas - outside_s * lone_deltas) / det, (lone_steps * outside_s - steps * lone_s) / det
        if per_pass >= 0 and per_delta >= 0:
            return per_pass, per_delta
    return 0.0, outside_s / deltas


def hop_under_load(measured: Measured) -> float | None:
    """A request's way to its worker and its first token's back under load (HTTP, the gateway, Ray): the load
    tester's mean TTFT over the warm-up less its workers' mean (`loraplex_gateway_worker_ttft_seconds`: from the
    request's arrival there, its prefix lookup, queue and prefill). None: not measured."""
    warm_up = measured.warm_up
    count = warm_up["loraplex_gateway_worker_ttft_seconds_count"]
    if not count or not measured.num_ttfts:
        return None
    return max(0.0, measured.ttft_s / measured.num_ttfts - warm_up["loraplex_gateway_worker_ttft_seconds_sum"] / count)


def lookup_terms(warm_up: Counter, lone: Counter, chunk_tokens: int) -> tuple[float, float] | None:
    """A prefix lookup's cost on a worker with a Redis tier (`loraplex_cache_lookup_seconds`): a round trip, one
    request at a time's mean (random prompts: misses), and each token fetched from Redis, the rest of the
    warm-up's lookups' time over the tokens they found there. None: no lookups measured."""
    if not lone["loraplex_cache_lookup_seconds_count"] or not warm_up["loraplex_cache_lookup_seconds_count"]:
        return None
    round_trip_s = lone["loraplex_cache_lookup_seconds_sum"] / lone["loraplex_cache_lookup_seconds_count"]
    fetched = warm_up["loraplex_cache_hit_chunks_l2"] * chunk_tokens
    rest_s = warm_up["loraplex_cache_lookup_seconds_sum"] - round_trip_s * warm_up["loraplex_cache_lookup_seconds_count"]
    return round_trip_s, max(0.0, rest_s) / fetched if fetched else 0.0


def beyond_passes(cpu_s: float, measured: Measured) -> float | None:
    """`cpu_s` of the warm-up less what the threads running the passes spent in them
    (`loraplex_engine_pass_cpu_seconds_total`), a request sent. None: not measured."""
    pass_cpu_s = measured.warm_up["loraplex_engine_pass_cpu_seconds_total"]
    if not measured.num_sent or not pass_cpu_s or not cpu_s:
        return None
    return max(0.0, cpu_s - pass_cpu_s) / measured.num_sent


def on_shared_cores(profile: CostProfile, measured: Measured) -> CostProfile | None:
    """The profile with its passes at their own cost, slowed as the machine's cores are shared at each moment
    (bench/sim/contention.py) by the engines and the serving path's CPU a request (the machine's busy CPU beyond the
    passes, `beyond_passes`), spent over a request's life (`life_s`), and by the share of it in the replica's own
    process (the replicas' processes' CPU beyond the passes), which holds the interpreter lock its engine needs; and
    the serving path's own terms (`serving_terms`). None: not measured."""
    per_request_s = beyond_passes(measured.busy_cpu_s, measured)  # the serving path's CPU a request
    if per_request_s is None:
        return None
    in_replica_s = beyond_passes(measured.replicas_cpu_s, measured) or 0.0  # of it, the replicas' processes'
    return replace(profile, name=f"{profile.name} on shared cores", shared_cores=measured.cores, serving_cpu_request_s=per_request_s,
                   replica_cpu_request_s=min(per_request_s, in_replica_s),
                   serving_window_s=measured.life_s or profile.serving_window_s,
                   **serving_terms(measured))


def under_load(profile: CostProfile, measured: Measured) -> tuple[CostProfile, float]:
    """The profile with every pass's cost scaled by how much slower the served replicas' passes were under
    the warm-up's load than it predicts: what the gateway, Ray, Redis and the load tester on the same cores, and
    a replica's own work beside its engine, cost its passes, which calibrating a bare engine leaves out. (The
    metrics count passes alone, the profile whole steps; on the idle server the two differed by less than their
    noise, 0.95-1.20 in three runs, so the ratio is not divided by an idle one, which only added that noise.) Beside
    the passes, the serving path's own terms (`serving_terms`)."""
    factor = pass_ratio(profile, measured.warm_up) or 1.0
    return replace(profile, name=f"{profile.name} under load", step_overhead_s=profile.step_overhead_s * factor,
                   prompt_token_s=profile.prompt_token_s * factor, decode_seq_s=profile.decode_seq_s * factor,
                   decode_context_s=0.0, **serving_terms(measured)), factor  # the factor takes the contexts' cost in (pass_ratio)


def serving_terms(measured: Measured) -> dict[str, float]:
    """The serving path's own costs beside the passes, each a term of a profile, measured on the real server: the
    engine loop's time around a pass and each delta (`loop_terms`), a request's way to its worker and back
    (`hop_under_load`), and its prefix lookup, a round trip and each token fetched from Redis (`lookup_terms`)."""
    loop_step_s, loop_delta_s = loop_terms(measured.warm_up, measured.lone)
    terms = {"loop_step_s": loop_step_s, "loop_delta_s": loop_delta_s}
    hop_s = hop_under_load(measured)
    if hop_s is not None:
        terms["hop_s"] = hop_s
    lookup = lookup_terms(measured.warm_up, measured.lone, measured.chunk_tokens) if measured.chunk_tokens else None
    if lookup is not None:
        terms["l2_lookup_s"], terms["l2_fetch_token_s"] = lookup
    return terms
