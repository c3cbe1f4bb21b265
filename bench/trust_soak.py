"""Trust soak: the bill, the keys and the quotas of `loraplex serve` under traffic and faults.

    python -m bench.trust_soak [--minutes 10] [--concurrency 6] [--port 8125]

Serves deploy/serve.yaml with its state store on a private Redis Cluster (3 masters, a replica
each, append-only files, no eviction: as production runs one; bench/cluster/redis_cluster.py)
and the prefix cache on the machine's Redis, behind two gateway replicas (Serve's proxy in
front). Four tenants are made at run time, one of them with a small daily token quota; every
client sends its next request when the last one ends (chat and completions, streamed with
`include_usage` or not), each answer's `usage` added to its tenant's sum. Meanwhile an operator
makes tenants, rotates keys (the clients move to the new key) and revokes keys (a revoked key is
then asked every 50 ms until it is refused: the time that takes), a caller without a key asks
every 2 s, and the state store's master is killed twice (the accounts' slot, then a tenant's usage
slot): its replica takes over. At the end, per tenant, the usage the answers said must equal the
ledger (`GET /v1/usage`), exactly; the quota tenant's ledger must stay within its quota; no
anonymous request may be answered. Loopback only; every loop bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.cluster.redis_cluster import LocalRedisCluster
from bench.server import Server, base_config, delete_keys

OPERATOR = {"Authorization": "Bearer sk-loraplex-operator"}
TOPICS = ["copper", "tin", "iron", "lead", "zinc", "gold", "silver", "nickel", "cobalt", "lithium"]
QUOTA_TOKENS = 3000
REVOKE_BOUND_S = 1.5  # ACCOUNTS_POLL_S (0.5 s) plus reads and round trips on a loaded 2-core machine


@dataclass
class Tenant:
    id: str
    key: str
    key_id: str
    answered_requests: int = 0
    answered_tokens: int = 0
    statuses: Counter = field(default_factory=Counter)


@dataclass
class Soak:
    url: str
    tenants: list[Tenant] = field(default_factory=list)
    quota_tenant: Tenant | None = None
    revoke_s: list[float] = field(default_factory=list)
    anonymous: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    fail_closed: Counter = field(default_factory=Counter)  # 503s that refused rather than served unchecked, by code

    def note_5xx(self, status: int, path: str, text: str) -> None:
        try:
            code = json.loads(text)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if status == 503 and code in ("quota_unavailable", "tenants_unavailable"):
            self.fail_closed[code] += 1
        else:
            self.errors.append(f"{status} on {path}: {text[:200]}")

    def say(self, what: str) -> None:
        line = f"  {time.monotonic() - self.t0:6.1f} s: {what}"
        self.events.append(line)
        print(line, file=sys.stderr, flush=True)


async def make_tenant(http: httpx.AsyncClient, **settings) -> Tenant:
    tenant_id = f"soak-{uuid.uuid4().hex[:8]}"
    r = await http.post("/v1/tenants", headers=OPERATOR, json={"id": tenant_id, "adapters": "*", **settings})
    r.raise_for_status()
    r = await http.post(f"/v1/tenants/{tenant_id}/keys", headers=OPERATOR, json={"name": "soak"})
    r.raise_for_status()
    return Tenant(tenant_id, r.json()["key"], r.json()["id"])


def body_of(rng: random.Random) -> tuple[str, dict]:
    topic = f"{rng.choice(TOPICS)} {rng.randrange(50)}"
    body: dict = {"max_tokens": rng.randrange(4, 25), "temperature": rng.choice([0.0, 0.8]), "stream": rng.random() < 0.5}
    adapter = rng.choice(["caps", "json", "signature", None])
    if adapter is not None:
        body["model"] = adapter
    else:
        body["model"] = "smollm2-135m-instruct"
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
    return "/v1/completions", {**body, "prompt": f"A short note on {topic}:"}


async def one(http: httpx.AsyncClient, tenant: Tenant, rng: random.Random, soak: Soak) -> int:
    """One request of `tenant`; its answer's usage added to the tenant's sum. The HTTP status (0: no answer)."""
    path, body = body_of(rng)
    headers = {"Authorization": f"Bearer {tenant.key}"}
    usage = None
    try:
        if body["stream"]:
            async with http.stream("POST", path, json=body, headers=headers) as response:
                status = response.status_code
                text = []
                async for line in response.aiter_lines():
                    text.append(line)
                    if status != 200 or not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        soak.errors.append(f"stream error on {path}: {event['error']}")
                        status = 599
                    elif event.get("usage"):
                        usage = event["usage"]
                if status >= 500 and status != 599:
                    soak.note_5xx(status, path, " ".join(text))
        else:
            response = await http.post(path, json=body, headers=headers)
            status = response.status_code
            if status == 200:
                usage = response.json()["usage"]
            elif status >= 500:
                soak.note_5xx(status, path, response.text)
    except httpx.HTTPError as e:
        soak.errors.append(f"no answer on {path}: {type(e).__name__}")
        return 0
    if status == 200:
        if usage is None:
            soak.errors.append(f"an answer without usage on {path}")
        else:
            tenant.answered_requests += 1
            tenant.answered_tokens += usage["prompt_tokens"] + usage["completion_tokens"]
    tenant.statuses[status] += 1
    return status


async def client(soak: Soak, seed: int, until: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=soak.url, timeout=120) as http:
        while time.monotonic() < until:
            tenant = rng.choice(soak.tenants)
            if await one(http, tenant, rng, soak) in (429, 503):
                await asyncio.sleep(0.5)


async def anonymous(soak: Soak, until: float) -> None:
    async with httpx.AsyncClient(base_url=soak.url, timeout=60) as http:
        while time.monotonic() < until:
            body = {"model": "smollm2-135m-instruct", "prompt": "hello", "max_tokens": 2}
            try:
                soak.anonymous[(await http.post("/v1/completions", json=body)).status_code] += 1
            except httpx.HTTPError:
                soak.anonymous[0] += 1
            await asyncio.sleep(2.0)


async def revoke_one(http: httpx.AsyncClient, soak: Soak, tenant: Tenant) -> None:
    """A new key of `tenant`, used once, revoked: asked (new connections) until refused; how long that took."""
    r = await http.post(f"/v1/tenants/{tenant.id}/keys", headers=OPERATOR, json={"name": "short-lived"})
    r.raise_for_status()
    key, key_id = r.json()["key"], r.json()["id"]
    probe = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 10
    while True:  # every gateway replica knows it (within the poll bound)
        async with httpx.AsyncClient(base_url=soak.url, timeout=30) as fresh:
            if (await fresh.get("/v1/models", headers=probe)).status_code == 200:
                break
        if time.monotonic() > deadline:
            raise AssertionError(f"a new key of {tenant.id} was not taken within 10 s")
        await asyncio.sleep(0.05)
    (await http.delete(f"/v1/tenants/{tenant.id}/keys/{key_id}", headers=OPERATOR)).raise_for_status()
    revoked_s = time.monotonic()
    deadline = revoked_s + 30
    while time.monotonic() < deadline:
        async with httpx.AsyncClient(base_url=soak.url, timeout=30) as fresh:
            if (await fresh.get("/v1/models", headers=probe)).status_code == 401:
                soak.revoke_s.append(time.monotonic() - revoked_s)
                return
        await asyncio.sleep(0.05)
    soak.revoke_s.append(float("inf"))
    soak.errors.append(f"revoked key {key_id} still served after 30 s")


def with_replica(cluster: LocalRedisCluster, keys: list[str]) -> str | None:
    """The first of `keys` whose slot's master still has a replica (one that can take over)."""
    for key in keys:
        if cluster.nodes[cluster.master_of(key)].ask("INFO", "replication").get("connected_slaves", 0):
            return key
    return None


async def operator(soak: Soak, until: float, cluster: LocalRedisCluster, kills: list[tuple[float, list[str]]]) -> None:
    """Every 15 s one change in turn (a new tenant, a key rotated, a key revoked); the state store's masters
    killed at the times given (the master of the slot of the first named key whose master has a replica)."""
    rng = random.Random(7)
    step = 0
    async with httpx.AsyncClient(base_url=soak.url, timeout=60) as http:
        while time.monotonic() < until:
            now = time.monotonic()
            for i, (at, keys) in enumerate(kills):
                if at <= now:
                    kills.pop(i)
                    key = with_replica(cluster, keys)
                    if key is None:
                        soak.say("no master with a replica left to kill")
                        break
                    master = cluster.master_of(key)
                    cluster.kill(master)
                    soak.say(f"killed the state store's master {master} (slot of {key})")
                    try:
                        new = await asyncio.to_thread(cluster.wait_for_new_master, key, master, 30.0)
                        soak.say(f"its replica {new} took over")
                    except RuntimeError as e:
                        soak.errors.append(str(e))
                    break
            try:
                kind = step % 3
                if kind == 0:
                    tenant = await make_tenant(http, tokens_per_min=20000)
                    soak.tenants.append(tenant)
                    soak.say(f"made tenant {tenant.id}")
                elif kind == 1:
                    tenant = rng.choice(soak.tenants)
                    r = await http.post(f"/v1/tenants/{tenant.id}/keys/{tenant.key_id}/rotate", headers=OPERATOR,
                                        json={"grace_s": 5})
                    r.raise_for_status()
                    tenant.key, tenant.key_id = r.json()["key"], r.json()["id"]
                    soak.say(f"rotated {tenant.id}'s key (5 s grace)")
                else:
                    await revoke_one(http, soak, rng.choice(soak.tenants))
                    soak.say(f"revoked a key: refused after {soak.revoke_s[-1]:.2f} s")
            except (httpx.HTTPError, AssertionError) as e:  # during a failover: said, and the next change comes
                soak.say(f"operator change failed: {type(e).__name__}: {e}")
            step += 1
            await asyncio.sleep(max(0.0, 15.0 - (time.monotonic() - now)))


async def ledger(url: str, tenant: Tenant) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.get("/v1/usage", headers=OPERATOR, params={"tenant": tenant.id})
        r.raise_for_status()
        return r.json()["totals"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--port", type=int, default=8125)
    args = parser.parse_args()
    prefix = f"loraplex-trust-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp, LocalRedisCluster(Path(tmp) / "state", is_durable=True) as cluster:
        cluster.start()
        config = base_config(prefix)
        config["state"] = {"redis_url": cluster.url, "cluster": True}
        config["http"] = {**config["http"], "gateway_replicas": 2, "listener": "serve-proxy"}
        print(f"state store: a Redis Cluster at {cluster.url}; starting loraplex serve (2 gateway replicas)...",
              file=sys.stderr, flush=True)
        server = Server(config, Path(tmp), args.port)
        soak = Soak(server.url)
        try:
            async def run() -> None:
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                    soak.tenants = [await make_tenant(http, tokens_per_min=20000) for _ in range(3)]
                    soak.tenants.append(await make_tenant(http, tokens_per_day=QUOTA_TOKENS))
                quota_tenant = soak.quota_tenant = soak.tenants[-1]
                soak.t0 = time.monotonic()
                until = soak.t0 + args.minutes * 60
                usage_slots = [f"{{{prefix}:usage:{t.id}}}:x" for t in soak.tenants]  # where each one's usage is
                kills = [(soak.t0 + 0.35 * args.minutes * 60, [f"{{{prefix}:tenants}}:version"]),
                         (soak.t0 + 0.7 * args.minutes * 60, usage_slots)]
                tasks = [client(soak, seed, until) for seed in range(args.concurrency)]
                tasks += [client_of(soak, quota_tenant, until), anonymous(soak, until), operator(soak, until, cluster, kills)]
                await asyncio.gather(*tasks)
                await asyncio.sleep(5.0)  # usage that waited out a failover is written by now

            async def client_of(soak: Soak, tenant: Tenant, until: float) -> None:
                rng = random.Random(99)
                async with httpx.AsyncClient(base_url=soak.url, timeout=120) as http:
                    while time.monotonic() < until:
                        if await one(http, tenant, rng, soak) in (429, 503):
                            await asyncio.sleep(1.0)

            asyncio.run(run())

            async def totals() -> list[dict]:
                return [await ledger(server.url, t) for t in soak.tenants]

            ledgers = asyncio.run(totals())
        finally:
            server.stop()
            delete_keys(redis.Redis(), prefix)
    report(soak, ledgers, args)


def report(soak: Soak, ledgers: list[dict], args: argparse.Namespace) -> None:
    mismatched = 0
    print(f"{sum(sum(t.statuses.values()) for t in soak.tenants)} requests in {args.minutes:g} min "
          f"({args.concurrency} clients and the quota tenant's own)")
    for tenant, totals in zip(soak.tenants, ledgers):
        billed_tokens = totals["prompt_tokens"] + totals["completion_tokens"]
        same = totals["requests"] == tenant.answered_requests and billed_tokens == tenant.answered_tokens
        mismatched += not same
        print(f"  {tenant.id}: answered {tenant.answered_requests} requests, {tenant.answered_tokens} tokens; "
              f"ledger {totals['requests']} requests, {billed_tokens} tokens {'==' if same else '!='} "
              f"statuses {dict(tenant.statuses)}")
    quota = ledgers[soak.tenants.index(soak.quota_tenant)]
    quota_tokens = quota["prompt_tokens"] + quota["completion_tokens"]
    finite = sorted(s for s in soak.revoke_s if s != float("inf"))
    for line in soak.errors[:10]:
        print(f"  error: {line}")
    print(f"trust_tenants_mismatched={mismatched}")
    print(f"trust_quota_tokens={quota_tokens} (quota {QUOTA_TOKENS}, overshoot {max(0, quota_tokens - QUOTA_TOKENS)})")
    print(f"trust_revocations={len(soak.revoke_s)} refused_within_s_max={max(soak.revoke_s, default=0):.2f} "
          f"p50={finite[len(finite) // 2] if finite else 0:.2f} (bound {REVOKE_BOUND_S})")
    print(f"trust_anonymous_answered={sum(n for s, n in soak.anonymous.items() if s == 200)} "
          f"(asked {sum(soak.anonymous.values())}: {dict(soak.anonymous)})")
    all_5xx = sum(n for t in soak.tenants for s, n in t.statuses.items() if s >= 500)
    print(f"trust_5xx={all_5xx - sum(soak.fail_closed.values())} (besides the fail-closed 503s: {dict(soak.fail_closed)}) "
          f"trust_no_answer={sum(t.statuses.get(0, 0) for t in soak.tenants)}")


if __name__ == "__main__":
    main()
