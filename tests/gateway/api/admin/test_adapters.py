"""Adapters registered at run time, in process (real workers on a tiny model, real Redis, the
app through TestClient): upload, serve, replace, remove, refusals, tenants, vLLM's endpoints."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from gguf import GGUFValueType

import worker.residency.residency
from tests.gateway.gateway_setup import ATTN, KEYS, PROMPT, auth, digest, local_app, tiny_config
from tests.tinymodels import random_lora, write_adapter

QUOTA_KEY = "key-quota"


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("registry")
    allowed = directory / "allowed"
    allowed.mkdir()
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    tenants = [{"id": "t1", "key_sha256": [digest(KEYS["t1"])], "adapter_paths": [str(allowed)]},
               {"id": "t2", "key_sha256": [digest(KEYS["t2"])], "adapters": ["b"]},
               {"id": "quota", "key_sha256": [digest(QUOTA_KEY)], "max_adapters": 1, "max_adapter_bytes": 15_000}]
    config = tiny_config(tiny_llama, directory, prefix, tenants=tenants, registry={
        "store_dir": str(directory / "store"), "allowed_paths": [str(allowed)], "poll_interval_s": 0.2,
        "garbage_age_s": 0, "resync_interval_s": 0.5})
    saved = worker.residency.residency.DRAIN_GRACE_S
    worker.residency.residency.DRAIN_GRACE_S = 0.2
    app, pool = local_app(config)
    with TestClient(app) as client:
        yield client, pool, directory, allowed, app.state.gateway, prefix
    worker.residency.residency.DRAIN_GRACE_S = saved
    pool.close()
    r = redis.Redis()
    for key in r.scan_iter(f"{prefix}:*"):
        r.delete(key)


def adapter_file(tiny, path, seed: int, **kwargs):
    return write_adapter(path, random_lora(tiny, ATTN, 4, seed=seed), **kwargs)


def upload(client, name, path, key="t1", part="file"):
    headers = {"Authorization": f"Bearer {KEYS.get(key, key)}"}
    with open(path, "rb") as f:
        return client.post("/v1/adapters", headers=headers, data={"name": name} if name is not None else {},
                           files={part: (os.path.basename(path), f, "application/octet-stream")})


def greedy(client, model, key="t1", **extra):
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS.get(key, key)}"},
                    json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, **extra})
    return r


def assert_same_output(got, want) -> None:
    """The same tokens and, to rounding, logprobs (a cached prefix computes fewer rows at once:
    the CPU's matmul kernels may round differently)."""
    got, want = got.json()["choices"][0]["logprobs"], want.json()["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"] and got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)


def test_an_uploaded_adapter_serves_at_once_for_its_tenant_only(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, _ = setup
    r = upload(client, "bot", adapter_file(tiny_llama, directory / "bot.gguf", 11))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["name"] == "bot" and body["rank"] == 4 and body["ready"] and body["shards"] and body["size_bytes"] > 0
    assert set(body["targets"]) == {"attn_q", "attn_v", "attn_output"} and len(body["fingerprint"]) == 64
    served = greedy(client, "bot")
    assert served.status_code == 200, served.text
    base = greedy(client, "tiny")
    logprobs = [r.json()["choices"][0]["logprobs"]["token_logprobs"] for r in (served, base)]
    assert logprobs[0] != logprobs[1]
    assert "bot" in [m["id"] for m in client.get("/v1/models", headers=auth()).json()["data"]]
    assert "bot" in [a["name"] for a in client.get("/lora-adapters", headers=auth()).json()]
    # tenant t2 cannot see, use, read or delete it, and has its own name space
    assert "bot" not in [m["id"] for m in client.get("/v1/models", headers=auth("t2")).json()["data"]]
    assert greedy(client, "bot", key="t2").status_code == 404
    assert client.get("/v1/adapters/bot", headers=auth("t2")).status_code == 404
    assert client.delete("/v1/adapters/bot", headers=auth("t2")).status_code == 404
    mine = upload(client, "bot", adapter_file(tiny_llama, directory / "bot-t2.gguf", 12), key="t2")
    assert mine.status_code == 201 and mine.json()["fingerprint"] != body["fingerprint"]
    assert client.get("/v1/adapters/bot", headers=auth()).json()["fingerprint"] == body["fingerprint"]
    assert_same_output(greedy(client, "bot"), served)
    listed = client.get("/v1/adapters", headers=auth()).json()["data"]
    assert [a["name"] for a in listed if not a["shared"]] == ["bot"]
    assert client.delete("/v1/adapters/bot", headers=auth("t2")).status_code == 200  # its own


def test_replacing_moves_the_name_and_never_serves_the_old_kv(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, _ = setup
    first = adapter_file(tiny_llama, directory / "v1.gguf", 21)
    second = adapter_file(tiny_llama, directory / "v2.gguf", 22)
    assert upload(client, "swap", first).status_code == 201
    old = greedy(client, "swap")
    again = greedy(client, "swap")
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prompt is cached under v1
    r = upload(client, "swap", second)
    assert r.status_code == 200 and r.json()["replaced"] is not None and r.json()["replaced"] != r.json()["fingerprint"]
    new = greedy(client, "swap")
    assert new.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # v1's KV is not v2's
    assert new.json()["choices"][0]["logprobs"] != old.json()["choices"][0]["logprobs"]
    assert upload(client, "swap", first).status_code == 200  # back to v1: v1's outputs
    assert_same_output(greedy(client, "swap"), old)


def test_removing_answers_404_and_the_workers_drop_it(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, _ = setup
    fingerprint = upload(client, "gone", adapter_file(tiny_llama, directory / "gone.gguf", 31)).json()["fingerprint"]
    assert greedy(client, "gone").status_code == 200
    r = client.delete("/v1/adapters/gone", headers=auth())
    assert r.status_code == 200 and r.json()["deleted"]
    assert greedy(client, "gone").status_code == 404
    assert client.delete("/v1/adapters/gone", headers=auth()).status_code == 404
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (any(fingerprint in w.residency.known for w in pool.workers.values())
                                           or gateway.registry.store.path(fingerprint).exists()):
        client.get("/v1/models", headers=auth())  # keeps the registry's loop going
        time.sleep(0.2)
    assert not any(fingerprint in w.residency.known for w in pool.workers.values())  # its weights are freed
    assert not gateway.registry.store.path(fingerprint).exists()  # and its file collected


ADAPTER_RULES = [
    ({"general_type": "model"}, "expect general.type to be 'adapter', but got: model"),
    ({"arch": "qwen2"}, "model arch and LoRA arch mismatch"),
    ({"adapter_type": "ia3"}, "expect adapter.type to be 'lora', but got: ia3"),
    ({"metadata": {"adapter.alora.invocation_tokens": (GGUFValueType.UINT32, 5, None)}},
     "invalid gguf type for adapter.alora.invocation_tokens"),
    ({"metadata": {"adapter.alora.invocation_tokens": (GGUFValueType.ARRAY, [1, 2], GGUFValueType.INT32)}},
     "invalid gguf element type for adapter.alora.invocation_tokens"),
    ({"extra_tensors": {"blk.0.attn_q.weight.lora_c": np.zeros((4, 64), np.float32)}},
     "LoRA tensor 'blk.0.attn_q.weight.lora_c' has unexpected suffix"),
]


@pytest.mark.parametrize(("kwargs", "message"), ADAPTER_RULES)
def test_a_malformed_upload_is_a_400_with_llama_cpps_message_and_changes_nothing(setup, tiny_llama, kwargs,
                                                                                 message) -> None:
    client, pool, directory, _, gateway, _ = setup
    before = client.get("/v1/adapters", headers=auth()).json()
    r = upload(client, "broken", adapter_file(tiny_llama, directory / "broken.gguf", 41, **kwargs))
    assert r.status_code == 400 and r.json()["error"]["message"] == message
    assert client.get("/v1/adapters", headers=auth()).json() == before


def test_tensor_rules_and_non_adapters_are_refused_alone(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, _ = setup
    pairs = random_lora(tiny_llama, ATTN, 4, seed=5)
    q = "blk.0.attn_q.weight"
    cases = [
        ({**pairs, q: (pairs[q][0], None)}, f"LoRA tensor pair for '{q}' is missing one component"),
        ({**pairs, "blk.9.attn_q.weight": pairs[q]}, "LoRA tensor 'blk.9.attn_q.weight' does not exist in base model"),
        ({**pairs, q: (pairs[q][0][:, :-1], pairs[q][1])}, f"tensor '{q}' has incorrect shape"),
        ({**pairs, q: (pairs[q][0], pairs[q][1][:, :2])}, "lora_a tensor is not transposed"),
    ]
    for i, (bad, message) in enumerate(cases):
        r = upload(client, "broken", write_adapter(directory / f"t{i}.gguf", bad))
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
    junk = directory / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    r = upload(client, "broken", junk)
    assert r.status_code == 400 and str(directory) not in r.text and "store" not in r.json()["error"]["message"]
    assert client.get("/v1/adapters/broken", headers=auth()).status_code == 404
    assert greedy(client, "tiny").status_code == 200  # nothing else is affected


def test_uploads_that_are_not_one_adapter_are_refused_clearly(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, _ = setup
    path = adapter_file(tiny_llama, directory / "ok.gguf", 51)
    assert upload(client, None, path).json()["error"]["message"].startswith("name:")
    assert upload(client, "../etc", path).status_code == 400
    assert upload(client, "tiny", path).status_code == 409  # the base model's name
    assert upload(client, "a", path).status_code == 409  # a shared adapter's name, which t1 uses
    mine = upload(client, "a", path, key="t2")  # t2 may not use the config's 'a': the name is free for its own
    assert mine.status_code == 201 and greedy(client, "a", key="t2").status_code == 200
    assert client.get("/v1/adapters/a", headers=auth()).json()["fingerprint"] != mine.json()["fingerprint"]
    r = upload(client, "x", path, part="weights")
    assert r.status_code == 400 and "send either a 'file' part" in r.json()["error"]["message"]
    r = client.post("/v1/adapters", headers=auth(), json={"name": "x"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    r = client.post("/v1/adapters", headers={**auth(), "content-type": "multipart/form-data; boundary=zz"},
                    content=b"--zz\r\ngarbage")
    assert r.status_code == 400
    assert client.post("/v1/adapters", files={"file": ("a", b"x")}, data={"name": "x"}).status_code == 401


def test_quotas_are_a_clear_403_and_leave_the_registry_as_it_was(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, _ = setup
    small = adapter_file(tiny_llama, directory / "q1.gguf", 61)
    assert upload(client, "one", small, key=QUOTA_KEY).status_code == 201
    r = upload(client, "two", adapter_file(tiny_llama, directory / "q2.gguf", 62), key=QUOTA_KEY)
    assert r.status_code == 403 and "limit is 1" in r.json()["error"]["message"]
    big = write_adapter(directory / "big.gguf", random_lora(tiny_llama, ATTN, 16, seed=63))
    r = upload(client, "one", big, key=QUOTA_KEY)  # replacing counts its new size
    assert r.status_code == 403 and "over its limit of 15000" in r.json()["error"]["message"]
    listed = client.get("/v1/adapters", headers={"Authorization": f"Bearer {QUOTA_KEY}"}).json()["data"]
    names = [a["name"] for a in listed if not a["shared"]]
    assert names == ["one"]


def test_vllm_load_and_unload_read_only_allowed_paths(setup, tiny_llama) -> None:
    client, pool, directory, allowed, gateway, _ = setup
    inside = adapter_file(tiny_llama, allowed / "vl.gguf", 71)
    outside = adapter_file(tiny_llama, directory / "secret.gguf", 72)
    (allowed / "link.gguf").symlink_to(outside)
    refused = (str(outside), str(allowed / ".." / "secret.gguf"), str(allowed / "link.gguf"), "/etc/passwd",
               "relative/../../x")
    for path in refused:
        r = client.post("/v1/load_lora_adapter", headers=auth(), json={"lora_name": "vl", "lora_path": path})
        assert r.status_code == 403, (path, r.text)
        assert "secret" not in r.text and "passwd" not in r.text and str(directory) not in r.text
    r = client.post("/v1/load_lora_adapter", headers=auth(),
                    json={"lora_name": "vl", "lora_path": str(allowed / "missing.gguf")})
    assert r.status_code == 404
    r = client.post("/v1/load_lora_adapter", headers=auth(), json={"lora_name": "vl", "lora_path": str(inside)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'vl' added successfully."
    assert greedy(client, "vl").status_code == 200
    r = client.post("/v1/load_lora_adapter", headers=auth(), json={"lora_name": "vl", "lora_path": str(inside)})
    assert r.status_code == 400 and "already been loaded" in r.text
    r = client.post("/v1/unload_lora_adapter", headers=auth(), json={"lora_name": "vl"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert greedy(client, "vl").status_code == 404
    assert client.post("/v1/unload_lora_adapter", headers=auth(), json={"lora_name": "vl"}).status_code == 404


def test_a_peft_upload_is_converted_and_serves_what_the_converter_makes(setup, tiny_llama, tmp_path) -> None:
    from tests.worker.formats.test_peft_convert import make_peft

    client, pool, directory, _, gateway, _ = setup
    make_peft(tiny_llama, tmp_path / "peft", seed=3, target_modules=["q_proj", "v_proj"])
    peft = tmp_path / "peft"
    with open(peft / "adapter_config.json", "rb") as c, open(peft / "adapter_model.safetensors", "rb") as w:
        r = client.post("/v1/adapters", headers=auth(), data={"name": "peft-bot"},
                        files={"adapter_config.json": ("adapter_config.json", c),
                               "adapter_model.safetensors": ("m.safetensors", w)})
    assert r.status_code == 201, r.text
    assert set(r.json()["targets"]) == {"attn_q", "attn_v"}
    from worker.formats.gguf_file import GGUFFile
    from worker.formats.peft_convert import ConvertOptions, convert_peft_to_gguf

    convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, tmp_path / "ref.gguf", ConvertOptions())
    from worker.formats.adapter import load_adapter

    reference = load_adapter(tmp_path / "ref.gguf", GGUFFile(tiny_llama.path))
    assert r.json()["fingerprint"] == reference.fingerprint  # what convert-lora makes
    assert greedy(client, "peft-bot").status_code == 200
    with open(tmp_path / "peft" / "adapter_config.json", "rb") as c:
        r = client.post("/v1/adapters", headers=auth(), data={"name": "peft-bad"},
                        files={"adapter_config.json": ("adapter_config.json", c),
                               "adapter_model.safetensors": ("m", b"\x08\x00\x00\x00\x00\x00\x00\x00{}")})
    assert r.status_code == 400 and "holds no LoRA tensors" in r.text
    with open(tmp_path / "peft" / "adapter_config.json", "rb") as c:
        r = client.post("/v1/adapters", headers=auth(), data={"name": "peft-bad"},
                        files={"adapter_config.json": ("adapter_config.json", c),
                               "adapter_model.safetensors": ("m", b"garbage" * 9)})
    assert r.status_code == 400 and str(tmp_path) not in r.text and str(directory) not in r.text
    assert client.get("/v1/adapters/peft-bad", headers=auth()).status_code == 404


def test_a_request_running_on_the_old_version_finishes_on_it(setup, tiny_llama) -> None:
    import threading

    client, pool, directory, _, gateway, _ = setup
    first = adapter_file(tiny_llama, directory / "r1.gguf", 81)
    second = adapter_file(tiny_llama, directory / "r2.gguf", 82)
    assert upload(client, "live", first).status_code == 201
    whole = greedy(client, "live", max_tokens=40, ignore_eos=True).json()["choices"][0]["text"]
    got: list[str] = []

    def run() -> None:
        got.append(greedy(client, "live", max_tokens=40, ignore_eos=True).json()["choices"][0]["text"])

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.05)
    assert upload(client, "live", second).status_code == 200
    thread.join()
    assert got == [whole]  # every token from the version it started on
    assert greedy(client, "live", max_tokens=40, ignore_eos=True).json()["choices"][0]["text"] != whole


def test_a_state_store_that_lost_the_registry_starts_again_above_every_version_seen(setup, tiny_llama) -> None:
    """Nothing writes an old registry back; the next change's version is above the one the workers hold,
    so they take the new pins (a version that went back would be ignored by every worker)."""
    client, pool, directory, _, gateway, prefix = setup
    assert upload(client, "durable", adapter_file(tiny_llama, directory / "durable.gguf", 91)).status_code == 201
    held = gateway.registry.version
    r = redis.Redis()
    lost = [key for key in r.scan_iter(f"{prefix}:*registry*")]
    assert lost and r.delete(*lost)  # the state store lost it (its disk too)
    assert upload(client, "afterwards", adapter_file(tiny_llama, directory / "afterwards.gguf", 92)).status_code == 201
    assert gateway.registry.version > held
    assert greedy(client, "afterwards").status_code == 200  # the workers took the new pins
    assert client.get("/v1/adapters/durable", headers=auth()).status_code == 404  # lost, not brought back


def test_changes_wait_for_an_unreachable_registry_and_serving_goes_on(setup, tiny_llama, monkeypatch) -> None:
    from gateway.registry.records import RegistryUnavailable

    client, pool, directory, _, gateway, _ = setup
    assert upload(client, "steady", adapter_file(tiny_llama, directory / "steady.gguf", 95)).status_code == 201

    async def down(*args, **kwargs):
        raise RegistryUnavailable("the adapter registry (Redis) is unavailable: ConnectionError")

    for method in ("transact", "version", "load"):
        monkeypatch.setattr(gateway.registry.records, method, down)
    r = upload(client, "later", adapter_file(tiny_llama, directory / "later.gguf", 96))
    assert r.status_code == 503 and r.headers["retry-after"]
    assert "registry is unavailable" in r.json()["error"]["message"]
    assert client.delete("/v1/adapters/steady", headers=auth()).status_code == 503
    assert greedy(client, "steady").status_code == 200  # what is known still serves
    assert client.get("/v1/adapters/steady", headers=auth()).status_code == 200


def test_a_garbage_collection_while_an_upload_is_staged_keeps_its_file(setup, tiny_llama, monkeypatch) -> None:
    """The file is stored before any record names it: a collection that runs then (here: at once, and
    garbage_age_s is 0) must not take it from under the registration."""
    client, _, directory, _, gateway, _ = setup
    registry = gateway.registry
    store = registry._store

    async def store_then_collect(staged, fingerprint) -> None:
        await store(staged, fingerprint)
        await registry.collect_garbage()

    monkeypatch.setattr(registry, "_store", store_then_collect)
    r = upload(client, "staged", adapter_file(tiny_llama, directory / "staged.gguf", 77))
    assert r.status_code == 201, r.text
    assert greedy(client, "staged").status_code == 200
    assert client.delete("/v1/adapters/staged", headers={"Authorization": f"Bearer {KEYS['t1']}"}).status_code == 200
