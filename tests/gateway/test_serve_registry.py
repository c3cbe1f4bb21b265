"""Adapters registered while `loraplex serve` runs (real Ray, real Redis, the default model,
two gateway replicas, two shards), with a background load that must see no failure:
add, replace and remove; bad uploads; quotas; tenants; and a restart of everything."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from pathlib import Path
from typing import Self

import httpx
import numpy as np
import openai
import pytest
from gguf import GGUFWriter

from bench.server import base_config
from tests.gateway.gateway_setup import digest
from tests.gateway.serve_process import running_serve
from tests.redis_server import RedisServer
from worker.formats.default_model import resolve_model_path
from worker.formats.gguf_file import GGUFFile

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEYS = {"demo": "sk-reg-demo", "acme": "sk-reg-acme", "tiny": "sk-reg-tiny", "operator": "sk-reg-operator"}
PROMPT = ("The history of copper mining begins in the Bronze Age, when people first learned to smelt ore into metal "
          "tools. Mines in Cyprus, Spain and Wales were worked for centuries, and the metal travelled along trade "
          "routes across the Mediterranean and beyond, where it was alloyed with tin to make bronze for weapons, "
          "ornaments and")  # > 2 cache chunks


def write_adapter(path: Path, seed: int, *, general_type: str = "adapter", arch: str | None = None,
                  adapter_type: str = "lora", transposed: bool = True) -> Path:
    """A random rank-8 adapter on the default model's first two layers' q and v."""
    base = GGUFFile(resolve_model_path(None))
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch or base.get("general.architecture"))
    w.add_string("general.type", general_type)
    w.add_string("adapter.type", adapter_type)
    w.add_float32("adapter.lora.alpha", 16.0)
    for layer in range(2):
        for name in ("attn_q", "attn_v"):
            info = base.tensors[f"blk.{layer}.{name}.weight"]
            a = (rng.standard_normal((8, info.ne(0))) / info.ne(0) ** 0.5).astype(np.float32)
            b = (rng.standard_normal((info.ne(1), 8 if transposed else 4)) * 0.5).astype(np.float32)
            w.add_tensor(f"blk.{layer}.{name}.weight.lora_a", a)
            w.add_tensor(f"blk.{layer}.{name}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class Deployment:
    """`loraplex serve` on one config, stopped and started again at will."""

    def __init__(self, config: dict, directory: Path) -> None:
        self.config, self.directory, self.stack, self.url = config, directory, None, ""

    def start(self) -> None:
        self.stack = contextlib.ExitStack()
        self.url = self.stack.enter_context(running_serve(self.config, self.directory))

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.close()
            self.stack = None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    directory = tmp_path_factory.mktemp("registry-serve")
    redis_server = RedisServer().start()
    config = base_config(f"loraplex-test-{uuid.uuid4().hex}")  # deploy/serve.yaml, adapter paths absolute
    config["tenants"] = [
        {"id": "demo", "key_sha256": [digest(KEYS["demo"])]},
        {"id": "acme", "key_sha256": [digest(KEYS["acme"])], "adapters": ["json"]},
        {"id": "tiny", "key_sha256": [digest(KEYS["tiny"])], "max_adapters": 1},
    ]
    config["operator_key_sha256"] = [digest(KEYS["operator"])]
    config["cache"]["redis_url"] = redis_server.url
    config["registry"] = {"store_dir": str(directory / "store"), "allowed_paths": [str(DEPLOY / "adapters")],
                          "poll_interval_s": 0.5}
    config["http"] = {"gateway_replicas": 2}
    served = Deployment(config, directory)
    served.start()
    yield served
    served.stop()
    redis_server.stop()


@pytest.fixture
def server(deployment) -> str:
    return deployment.url


def auth(tenant: str = "demo") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def upload(url: str, name: str, path: Path, tenant: str = "demo") -> httpx.Response:
    with open(path, "rb") as f:
        return httpx.post(f"{url}/v1/adapters", headers=auth(tenant), data={"name": name},
                          files={"file": (path.name, f)}, timeout=120)


def complete(url: str, model: str, tenant: str = "demo", **extra) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, **extra)


class BackgroundLoad:
    """Requests on the base and on a config adapter, streamed and not, until stopped; counts failures."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.done, self.failures = url, threading.Event(), 0, []
        self.threads = [threading.Thread(target=self._run, args=(model, stream), daemon=True)
                        for model, stream in (("smollm2-135m-instruct", False), ("caps", True), ("json", False))]

    def _run(self, model: str, stream: bool) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS["demo"], max_retries=0, timeout=120)
        while not self.stop.is_set():
            try:
                if stream:
                    text = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="Copper is",
                                                                                        max_tokens=6, stream=True))
                else:
                    text = client.completions.create(model=model, prompt="Copper is", max_tokens=6).choices[0].text
                assert isinstance(text, str)
                self.done += 1
            except Exception as e:  # noqa: BLE001 - any failure is the test's failure
                self.failures.append(f"{model}: {type(e).__name__}: {e}")

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_add_replace_remove_while_serving_fail_no_request(server, deployment) -> None:
    directory = deployment.directory
    first, second = write_adapter(directory / "v1.gguf", 1), write_adapter(directory / "v2.gguf", 2)
    with BackgroundLoad(server) as load:
        time.sleep(1.0)
        started = time.monotonic()
        r = upload(server, "support-bot", first)
        assert r.status_code == 201, r.text
        assert r.json()["ready"] and len(r.json()["shards"]) == 2  # two copies, on distinct shards
        fingerprint = r.json()["fingerprint"]
        old = complete(server, "support-bot")
        servable_s = time.monotonic() - started
        assert servable_s < 20
        # both gateway replicas see it: the proxy spreads these over them
        for _ in range(20):
            models = httpx.get(f"{server}/v1/models", headers=auth()).json()["data"]
            assert "support-bot" in [m["id"] for m in models]
        assert complete(server, "support-bot").usage.prompt_tokens_details.cached_tokens > 0  # cached under v1
        r = upload(server, "support-bot", second)
        assert r.status_code == 200 and r.json()["replaced"] == fingerprint and r.json()["fingerprint"] != fingerprint
        new = complete(server, "support-bot")
        assert new.usage.prompt_tokens_details.cached_tokens == 0  # v1's KV is never v2's
        assert new.choices[0].logprobs.token_logprobs != old.choices[0].logprobs.token_logprobs
        assert httpx.delete(f"{server}/v1/adapters/support-bot", headers=auth()).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete(server, "support-bot")
        time.sleep(1.0)
    assert load.failures == [] and load.done > 10


def test_bad_uploads_quota_and_tenants(server, deployment) -> None:
    directory = deployment.directory
    before = httpx.get(f"{server}/v1/adapters", headers=auth()).json()
    cases = [(write_adapter(directory / "m1.gguf", 3, general_type="model"),
              "expect general.type to be 'adapter', but got: model"),
             (write_adapter(directory / "m2.gguf", 3, arch="qwen2"), "model arch and LoRA arch mismatch"),
             (write_adapter(directory / "m3.gguf", 3, adapter_type="ia3"),
              "expect adapter.type to be 'lora', but got: ia3"),
             (write_adapter(directory / "m4.gguf", 3, transposed=False), "lora_a tensor is not transposed")]
    for path, message in cases:
        r = upload(server, "broken", path)
        assert r.status_code == 400 and r.json()["error"]["message"] == message
    assert httpx.get(f"{server}/v1/adapters", headers=auth()).json() == before
    # a quota of one adapter
    assert upload(server, "mine", write_adapter(directory / "q1.gguf", 4), tenant="tiny").status_code == 201
    r = upload(server, "more", write_adapter(directory / "q2.gguf", 5), tenant="tiny")
    assert r.status_code == 403 and "limit is 1" in r.json()["error"]["message"]
    # names are per tenant: acme's own 'mine' leaves tiny's alone; neither sees, uses or deletes the other's
    tiny_fp = httpx.get(f"{server}/v1/adapters/mine", headers=auth("tiny")).json()["fingerprint"]
    assert httpx.get(f"{server}/v1/adapters/mine", headers=auth("acme")).status_code == 404
    with pytest.raises(openai.NotFoundError):
        complete(server, "mine", tenant="acme")
    assert httpx.delete(f"{server}/v1/adapters/mine", headers=auth("acme")).status_code == 404
    assert upload(server, "mine", write_adapter(directory / "q3.gguf", 6), tenant="acme").status_code == 201
    assert httpx.get(f"{server}/v1/adapters/mine", headers=auth("tiny")).json()["fingerprint"] == tiny_fp
    tiny, acme = (complete(server, "mine", tenant=t).choices[0].logprobs.token_logprobs for t in ("tiny", "acme"))
    assert tiny != acme


def test_vllm_endpoints_read_only_the_allowed_directory(server, deployment) -> None:
    directory = deployment.directory
    caps = str(DEPLOY / "adapters" / "caps.gguf")
    for tenant in ("acme", "demo"):  # loading by path is the operator's (these tenants have no adapter_paths)
        r = httpx.post(f"{server}/v1/load_lora_adapter", headers=auth(tenant), json={"lora_name": "mycaps", "lora_path": caps})
        assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed"
    with pytest.raises(openai.NotFoundError):
        complete(server, "mycaps", tenant="acme")
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=auth("operator"),
                   json={"lora_name": "from-disk", "lora_path": caps})
    assert r.status_code == 200 and "added successfully" in r.text
    assert complete(server, "from-disk").choices[0].text
    for path in (str(directory / "v1.gguf"), str(DEPLOY / "adapters" / ".." / "serve.yaml"), "/etc/hostname"):
        r = httpx.post(f"{server}/v1/load_lora_adapter", headers=auth("operator"), json={"lora_name": "x", "lora_path": path})
        assert r.status_code == 403 and "hostname" not in r.text and "serve.yaml" not in r.text
    r = httpx.post(f"{server}/v1/unload_lora_adapter", headers=auth("operator"), json={"lora_name": "from-disk"})
    assert r.status_code == 200


def test_the_adapters_cli_adds_lists_and_removes(server, deployment) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "gateway.cli", "adapters", "--url", server, "--key", KEYS["demo"], *args]
        return subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)

    added = cli("add", "cli-bot", str(write_adapter(deployment.directory / "cli.gguf", 8)))
    assert added.returncode == 0 and added.stdout.startswith("added cli-bot"), added.stderr
    assert complete(server, "cli-bot").choices[0].text
    listed = cli("list")
    assert listed.returncode == 0 and "cli-bot" in listed.stdout and "caps" in listed.stdout
    bad = cli("add", "cli-bad", str(write_adapter(deployment.directory / "cli-bad.gguf", 8, arch="qwen2")))
    assert bad.returncode == 1 and "400: model arch and LoRA arch mismatch" in bad.stderr
    assert cli("rm", "cli-bot").returncode == 0
    assert "cli-bot" not in cli("list").stdout and cli("rm", "cli-bot").returncode == 1


def cli(server: str, *args: str) -> str:
    """`loraplex ARGS...` as the operator; its output (it must succeed)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "gateway.cli", args[0], "--url", server, "--key", KEYS["operator"], *args[1:]]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def until_every_gateway(server: str, key: str, status: int, bound_s: float) -> float:
    """Seconds until `key` got `status` on 16 requests in a row (from the first of them), each on a new
    connection (the two gateway replicas share the port: the kernel spreads new connections over them)."""
    started = time.monotonic()
    in_a_row, streak_s = 0, 0.0
    while in_a_row < 16:
        assert time.monotonic() - started < bound_s + 5, f"not {status} on every gateway after {bound_s + 5} s"
        sent_s = time.monotonic()
        got = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
        streak_s = streak_s if got == status and in_a_row else sent_s
        in_a_row = in_a_row + 1 if got == status else 0
    return streak_s - started


def test_run_time_tenants_keys_quotas_and_usage_on_two_gateways(server) -> None:
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    assert tenant in cli(server, "tenants", "create", tenant, "--adapters", "caps")
    key = cli(server, "keys", "create", tenant, "--name", "ci").splitlines()[0]
    new_key_s = until_every_gateway(server, key, 200, 1.0)
    assert new_key_s < 1.5  # usable on both replicas within a second
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=120)
    answers = [client.completions.create(model="caps", prompt=PROMPT, max_tokens=5).usage,
               client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=4,
                                              messages=[{"role": "user", "content": "Hi"}]).usage]
    chunks = list(client.completions.create(model="caps", prompt="Copper is", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    answers.append(chunks[-1].usage)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="json", prompt="x", max_tokens=2)  # not in its ACL; not counted

    key_id = cli(server, "keys", "list", tenant).split()[0]
    rotated = cli(server, "keys", "rotate", tenant, key_id).splitlines()[0]
    old_key_s = until_every_gateway(server, key, 401, 0.5)
    assert old_key_s < 1.5  # the old key refused everywhere within the bound
    assert until_every_gateway(server, rotated, 200, 0.5) < 1.5
    print(f"\ntwo gateway replicas: a new key served on every one after {new_key_s:.2f} s, a rotated-out key refused "
          f"on every one after {old_key_s:.2f} s")

    usage = httpx.get(f"{server}/v1/usage", headers={"Authorization": f"Bearer {rotated}"}).json()["totals"]
    assert usage["requests"] == 3
    assert usage["prompt_tokens"] == sum(u.prompt_tokens for u in answers)
    assert usage["completion_tokens"] == sum(u.completion_tokens for u in answers)
    assert usage["cached_tokens"] == sum(u.prompt_tokens_details.cached_tokens for u in answers)
    as_csv = cli(server, "usage", "--tenant", tenant, "--format", "csv")
    assert as_csv.startswith("hour,tenant,key_id,") and len(as_csv.splitlines()) == 3  # the header, caps and the base

    used = usage["prompt_tokens"] + usage["completion_tokens"]
    cli(server, "tenants", "update", tenant, "--tokens-per-day", str(used + 1))
    until_every_gateway(server, rotated, 200, 0.5)
    time.sleep(1.1)  # every gateway's reading of the day's count is fresh
    with pytest.raises(openai.RateLimitError) as refused:
        openai.OpenAI(base_url=f"{server}/v1", api_key=rotated, max_retries=0).completions.create(
            model="caps", prompt=PROMPT, max_tokens=2)
    assert "token quota per day" in str(refused.value)
    cli(server, "tenants", "update", tenant, "--tokens-per-day", str(10**9))


def test_a_restart_of_everything_keeps_the_registry(deployment) -> None:
    assert upload(deployment.url, "survivor", write_adapter(deployment.directory / "s.gguf", 7)).status_code == 201
    listed = httpx.get(f"{deployment.url}/v1/adapters", headers=auth()).json()
    expected = complete(deployment.url, "survivor").choices[0].logprobs
    tenant = f"keeper-{uuid.uuid4().hex[:6]}"
    cli(deployment.url, "tenants", "create", tenant)
    key = cli(deployment.url, "keys", "create", tenant).splitlines()[0]
    until_every_gateway(deployment.url, key, 200, 0.5)
    openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=key, max_retries=0, timeout=120).completions.create(
        model="caps", prompt="Copper is", max_tokens=3)
    usage = httpx.get(f"{deployment.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    deployment.stop()  # every process: gateways, workers, Ray
    deployment.start()
    assert httpx.get(f"{deployment.url}/v1/adapters", headers=auth()).json() == listed
    # the run-time tenant, its key and its usage are the deployment's, not a process's
    assert httpx.get(f"{deployment.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["data"] == usage
    # its prefix from the cache now: the same to rounding
    after = complete(deployment.url, "survivor").choices[0].logprobs
    assert after.tokens == expected.tokens and after.token_logprobs == pytest.approx(expected.token_logprobs, abs=1e-4)
