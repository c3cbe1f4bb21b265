"""Adapters registered at run time through an adapter store in S3 (a real S3-compatible server,
moto_server, reached by boto3 through AWS_ENDPOINT_URL), with the workers on another "node":
their cache directory is not the gateway's, so what they serve came from the store, never from
the gateway's disk. In process: real workers on a tiny model, real Redis, the app through
TestClient."""

from __future__ import annotations

import hashlib
import time
import uuid

import boto3
import pytest
import redis
from botocore.config import Config
from fastapi.testclient import TestClient

import worker.residency.residency
from tests.gateway.api.admin.test_adapters import adapter_file, assert_same_output, greedy, upload
from tests.gateway.gateway_setup import auth, local_app, tiny_config
from tests.redis_server import free_port
from tests.s3_server import bucket_name, running_s3
from worker.formats.adapter import load_adapter
from worker.formats.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("blob-registry")
    allowed = directory / "allowed"
    allowed.mkdir()
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    saved = worker.residency.residency.DRAIN_GRACE_S
    worker.residency.residency.DRAIN_GRACE_S = 0.2
    with running_s3():
        bucket = bucket_name()
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=bucket)
        config = tiny_config(tiny_llama, directory, prefix, registry={
            "store_url": f"s3://{bucket}/adapters", "store_dir": str(directory / "gateway-cache"),
            "allowed_paths": [str(allowed)], "poll_interval_s": 0.2, "garbage_age_s": 0, "resync_interval_s": 0.5,
            "load_timeout_s": 20})
        worker_node = config.model_copy(update={"registry": config.registry.model_copy(
            update={"store_dir": str(directory / "worker-cache")})})
        app, pool = local_app(config, worker_config=worker_node)
        with TestClient(app) as client:
            yield client, pool, directory, allowed, app.state.gateway, s3, bucket
        pool.close()
    worker.residency.residency.DRAIN_GRACE_S = saved
    r = redis.Redis()
    for key in r.scan_iter(f"{prefix}:*"):
        r.delete(key)


def fingerprint_of(tiny, path) -> str:
    return load_adapter(path, GGUFFile(tiny.path)).fingerprint


def stored_keys(s3, bucket: str) -> set[str]:
    return {item["Key"] for item in s3.list_objects_v2(Bucket=bucket).get("Contents", ())}


def test_an_upload_is_stored_in_s3_and_served_by_workers_that_fetched_it(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, s3, bucket = setup
    source = adapter_file(tiny_llama, directory / "remote.gguf", 41)
    r = upload(client, "remote", source)
    assert r.status_code == 201, r.text
    fingerprint = r.json()["fingerprint"]
    head = s3.head_object(Bucket=bucket, Key=f"adapters/{fingerprint}.gguf")  # stored before the answer
    assert head["Metadata"]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    served = greedy(client, "remote")
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["logprobs"] != greedy(client, "tiny").json()["choices"][0]["logprobs"]
    # the workers' copy came from the store into their own cache; the gateway's disk holds none
    assert (directory / "worker-cache" / f"{fingerprint}.gguf").read_bytes() == source.read_bytes()
    assert not (directory / "gateway-cache" / f"{fingerprint}.gguf").exists()
    assert all(w.residency.store.directory == directory / "worker-cache" for w in pool.workers.values())
    assert any(fingerprint in w.residency.known for w in pool.workers.values())


def test_vllm_load_lora_adapter_goes_through_the_store_too(setup, tiny_llama) -> None:
    client, pool, _, allowed, gateway, s3, bucket = setup
    path = adapter_file(tiny_llama, allowed / "vl.gguf", 42)
    r = client.post("/v1/load_lora_adapter", headers=auth("operator"), json={"lora_name": "vl", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert f"adapters/{fingerprint_of(tiny_llama, path)}.gguf" in stored_keys(s3, bucket)
    assert greedy(client, "vl").status_code == 200


def test_a_pin_whose_blob_cannot_be_fetched_leaves_the_name_where_it_was(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, s3, bucket = setup
    first = adapter_file(tiny_llama, directory / "keep-v1.gguf", 43)
    second = adapter_file(tiny_llama, directory / "keep-v2.gguf", 44)
    assert upload(client, "keep", first).status_code == 201
    before = greedy(client, "keep")
    # the store holds rotten bytes under v2's fingerprint (with v2's digest: the upload finds it stored)
    fingerprint = fingerprint_of(tiny_llama, second)
    s3.put_object(Bucket=bucket, Key=f"adapters/{fingerprint}.gguf", Body=b"rotten" * 1000,
                  Metadata={"sha256": hashlib.sha256(second.read_bytes()).hexdigest()})
    r = upload(client, "keep", second)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    error = r.json()["error"]
    assert error["code"] == "adapter_not_loaded" and "no worker could load" in error["message"] and fingerprint in error["message"]
    assert client.get("/v1/adapters/keep", headers=auth()).json()["fingerprint"] != fingerprint  # the name did not move
    assert_same_output(greedy(client, "keep"), before)
    assert any(fingerprint in w.residency.failed for w in pool.workers.values())  # the workers it was pinned on said why
    assert not any(fingerprint in w.residency.known for w in pool.workers.values())
    assert not (directory / "worker-cache" / f"{fingerprint}.gguf").exists()  # nothing unverified was kept


def test_an_unreachable_store_refuses_the_upload_and_changes_nothing(setup, tiny_llama, monkeypatch) -> None:
    client, pool, directory, _, gateway, s3, bucket = setup
    unreachable = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{free_port()}", config=Config(
        retries={"max_attempts": 1}, connect_timeout=1))
    monkeypatch.setattr(gateway.registry.store, "client", unreachable)
    r = upload(client, "nowhere", adapter_file(tiny_llama, directory / "nowhere.gguf", 45))
    assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_store_unavailable"
    assert "127.0.0.1" not in r.text and bucket not in r.text  # nothing internal in the answer
    monkeypatch.undo()
    assert client.get("/v1/adapters/nowhere", headers=auth()).status_code == 404


def test_a_removed_adapter_is_deleted_from_the_store(setup, tiny_llama) -> None:
    client, pool, directory, _, gateway, s3, bucket = setup
    fingerprint = upload(client, "gone", adapter_file(tiny_llama, directory / "gone.gguf", 46)).json()["fingerprint"]
    key = f"adapters/{fingerprint}.gguf"
    assert greedy(client, "gone").status_code == 200 and key in stored_keys(s3, bucket)
    assert client.delete("/v1/adapters/gone", headers=auth()).status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (key in stored_keys(s3, bucket)
                                           or any(fingerprint in w.residency.known for w in pool.workers.values())):
        client.get("/v1/models", headers=auth())  # keeps the registry's loop going
        time.sleep(0.2)
    assert key not in stored_keys(s3, bucket)
    assert not any(fingerprint in w.residency.known for w in pool.workers.values())
