"""The chart's two Redis: the prefix cache's (evicting, disposable, behind a network policy) and the
state store (never evicting, its data on a volume, its password in every Ray pod), and a chart
without a state store refused unless told state may be lost."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from urllib.parse import urlsplit

import helm_python as helm
import pytest

from cache.l2 import connect
from gateway.config import parse_config
from gateway.state import StateSettings, StateStoreRefused, check, state_redis
from tests.deploy.test_helm import CHART, KEYED, by_name, config_in_pod, lint, render, serve_config
from tests.redis_server import RedisServer


def test_defaults_run_redis_with_lru_eviction_behind_a_network_policy() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render()}
    redis = docs[("StatefulSet", "lp-loraplex-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:4] == ["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]
    policy = docs[("NetworkPolicy", "lp-loraplex-redis")]["spec"]
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "ray"
    assert ("Secret", "lp-loraplex-redis") in docs and ("Ingress", "lp-loraplex") not in docs


def redis_bytes(size: str) -> int:
    number = size.rstrip("bgkm")
    return int(number) * {"": 1, "b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}[size[len(number):]]


def test_the_state_store_is_a_redis_of_its_own_that_never_evicts_and_keeps_its_data_on_a_volume() -> None:
    docs = by_name(render())
    state = docs[("StatefulSet", "lp-loraplex-state")]["spec"]
    container = state["template"]["spec"]["containers"][0]
    args = dict(zip(container["args"][::2], container["args"][1::2], strict=True))
    assert (args["--maxmemory-policy"], args["--appendonly"], args["--appendfsync"]) == ("noeviction", "yes", "everysec")
    assert container["resources"]["limits"]["memory"] == "2Gi"
    assert redis_bytes(args["--maxmemory"]) < 2 * 1024**3  # room under the limit for an AOF rewrite's fork
    claim = state["volumeClaimTemplates"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert mount["mountPath"] == args["--dir"] == "/data"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert "redis-cli" in str(container["readinessProbe"]["exec"])  # not ready while it replays the append-only file
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "lp-loraplex-state"
    assert ("Secret", "lp-loraplex-state") in docs
    cache = docs[("StatefulSet", "lp-loraplex-redis")]["spec"]["template"]["spec"]["containers"][0]
    cache_args = dict(zip(cache["args"][::2], cache["args"][1::2], strict=True))
    assert (cache_args["--maxmemory-policy"], cache_args["--appendonly"]) == ("allkeys-lru", "no")  # disposable
    pod_labels = state["template"]["metadata"]["labels"]
    assert docs[("Service", "lp-loraplex-state")]["spec"]["selector"].items() <= pod_labels.items()
    assert not docs[("Service", "lp-loraplex-redis")]["spec"]["selector"].items() <= pod_labels.items()
    policy = docs[("NetworkPolicy", "lp-loraplex-state")]["spec"]
    assert policy["podSelector"]["matchLabels"] == pod_labels
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "ray"


def test_the_gateway_accepts_a_redis_run_as_the_chart_runs_the_state_store_and_refuses_the_caches(tmp_path) -> None:
    """The StatefulSets' args on a real redis-server (here, without a password), through the check a gateway
    makes when it starts (gateway/state.py)."""
    docs = by_name(render({"state": {"auth": {"enabled": False}}, "redis": {"auth": {"enabled": False}}}))

    def check_server(name: str) -> None:
        args = docs[("StatefulSet", name)]["spec"]["template"]["spec"]["containers"][0]["args"]
        args = [str(tmp_path / name) if previous == "--dir" else a for previous, a in zip(["", *args], args)]
        (tmp_path / name).mkdir()
        server = RedisServer(args=tuple(args)).start()
        settings = StateSettings(redis_url=server.url)
        store = state_redis(settings, None)

        async def run() -> None:
            client = connect(store, is_async=True)
            try:
                await check(settings, store, client)
            finally:
                await client.aclose()

        try:
            asyncio.run(run())
        finally:
            server.stop()

    check_server("lp-loraplex-state")
    assert any((tmp_path / "lp-loraplex-state").iterdir())  # the append-only file, in the volume's --dir
    with pytest.raises(StateStoreRefused, match="noeviction"):
        check_server("lp-loraplex-redis")


def test_the_state_store_keeps_a_claim_of_yours_and_a_storage_class() -> None:
    values = {"state": {"persistence": {"existingClaim": "loraplex-state", "storageClass": "fast-ssd"}}}
    lint(values)
    state = by_name(render(values))[("StatefulSet", "lp-loraplex-state")]["spec"]
    assert "volumeClaimTemplates" not in state
    assert state["template"]["spec"]["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "loraplex-state"}}]
    claim = by_name(render({"state": {"persistence": {"storageClass": "fast-ssd"}}}))[("StatefulSet", "lp-loraplex-state")]
    assert claim["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-ssd"


def test_the_config_keeps_state_in_the_state_redis_with_its_password_mounted_in_every_ray_pod(tmp_path) -> None:
    docs = render(KEYED)
    config = serve_config(next(d for d in docs if d["kind"] == "RayService"))
    url = urlsplit(config["state"]["redis_url"])
    assert (url.hostname, url.port) == ("lp-loraplex-state", 6379) and ("Service", url.hostname) in by_name(docs)
    assert config["state"]["password_file"] == "/etc/loraplex/state-redis/password"
    parsed = parse_config(config_in_pod(docs, tmp_path), ".", "serveConfigV2")  # asserts the mounts, too
    store = parsed.state_redis()
    assert store.url == config["state"]["redis_url"] != parsed.cache.redis.url and not parsed.state.ephemeral
    secret = by_name(docs)[("Secret", "lp-loraplex-state")]["data"]["password"]
    assert Path(store.password_file).read_text() == base64.b64decode(secret).decode()  # the pod reads the server's password


def test_without_a_state_store_the_chart_refuses_unless_told_state_may_be_lost(tmp_path) -> None:
    none = {"state": {"enabled": False}}
    with pytest.raises(helm.HelmError, match="no state store") as e:
        render(none)
    assert "state.external.url" in str(e.value) and "state.ephemeral: true" in str(e.value)
    shared = {"redis": {"enabled": False, "external": {"url": "redis://r:6379/0"}},
              "state": {"enabled": False, "external": {"url": "redis://r:6379/0"}}}
    with pytest.raises(helm.HelmError, match="is the cache's Redis"):
        render(shared)
    ephemeral = {"state": {"enabled": False, "ephemeral": True}, **KEYED}
    lint(ephemeral)
    docs = render(ephemeral)
    assert all(name != "lp-loraplex-state" for _, name in by_name(docs))
    config = serve_config(next(d for d in docs if d["kind"] == "RayService"))
    assert config["state"] == {"ephemeral": True}
    parsed = parse_config(config_in_pod(docs, tmp_path), ".", "serveConfigV2")
    assert parsed.state_redis() == parsed.cache.redis  # the cache's Redis: it evicts, and keeps nothing on disk
    notes = helm.Chart.load(str(CHART)).render(ephemeral, name="lp", namespace="serving", is_install=True)
    assert "bills, keys and registered adapters" in notes["loraplex/templates/NOTES.txt"]
    render({**shared, "state": {**shared["state"], "ephemeral": True}})
