"""A DoRA adapter through the gateway: served unmerged by the in-process workers, and refused (400,
before any worker) when a request stacks it with another adapter."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient

from tests.gateway.gateway_setup import auth, local_serving, tiny_config
from tests.worker.formats.test_dora import dora_file


def test_a_dora_adapter_is_served_alone_and_never_stacked(tiny_llama, tmp_path) -> None:
    dora_file(tiny_llama, tmp_path / "dora.gguf")
    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}")
    data = config.model_dump()
    data["adapters"].append({"name": "d", "path": str(tmp_path / "dora.gguf")})
    data["shards"][0]["adapters"].append("d")
    config = type(config).model_validate(data)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with local_serving(config) as (app, _), TestClient(app) as client:
        base = client.post("/v1/completions", headers=auth(), json={**body, "model": "tiny"}).json()
        alone = client.post("/v1/completions", headers=auth(), json={**body, "model": "d"})
        assert alone.status_code == 200, alone.text
        assert alone.json()["choices"][0]["text"] != base["choices"][0]["text"]  # the DoRA changed the answer
        stacked = client.post("/v1/completions", headers=auth(), json={**body, "model": "d", "lora": [{"name": "a", "scale": 1}]})
        assert stacked.status_code == 400 and stacked.json()["error"]["code"] == "dora_stacked", stacked.text
        plain = client.post("/v1/completions", headers=auth(), json={**body, "model": "a", "lora": [{"name": "alo", "scale": 0}]})
        assert plain.status_code == 200  # stacking plain LoRAs stays allowed
