"""Who may name what, in process (real workers on a tiny model, real Redis, the app through
TestClient): loading an adapter by server path is the operator's, and a tenant's only within its
own adapter_paths; a tenant whose ACL lists its adapters is never served a shared adapter it may
not use, by content, under whatever name and whoever registered it, alone or stacked, in any API."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import redis
from fastapi.testclient import TestClient

from tests.gateway.api.admin.test_adapters import adapter_file, assert_same_output, greedy, upload
from tests.gateway.gateway_setup import KEYS, PROMPT, auth, digest, local_app, tiny_config

T3_KEY = "key-three"  # a tenant whose adapter_paths lie outside registry.allowed_paths
OPERATOR = auth("operator")


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("acl")
    allowed, outside = directory / "allowed", directory / "outside"
    (allowed / "t2").mkdir(parents=True)
    outside.mkdir()
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    tenants = [{"id": "t1", "key_sha256": [digest(KEYS["t1"])]},
               {"id": "t2", "key_sha256": [digest(KEYS["t2"])], "adapters": ["b"], "adapter_paths": ["allowed/t2"]},
               {"id": "t3", "key_sha256": [digest(T3_KEY)], "adapter_paths": [str(outside)]}]
    config = tiny_config(tiny_llama, directory, prefix, tenants=tenants, registry={
        "store_dir": str(directory / "store"), "allowed_paths": ["allowed"], "poll_interval_s": 0.2})
    app, pool = local_app(config)
    with TestClient(app) as client:
        yield client, directory, allowed, outside
    pool.close()
    r = redis.Redis()
    for key in r.scan_iter(f"{prefix}:*"):
        r.delete(key)


def load(client, name: str, path, key: str = "t1", **extra):
    headers = OPERATOR if key == "operator" else {"Authorization": f"Bearer {KEYS.get(key, key)}"}
    return client.post("/v1/load_lora_adapter", headers=headers, json={"lora_name": name, "lora_path": str(path), **extra})


def upload_as_operator(client, name: str, path, owner: str | None = None):
    with open(path, "rb") as f:
        return client.post("/v1/adapters", headers=OPERATOR, params={"owner": owner} if owner is not None else {},
                           data={"name": name}, files={"file": (os.path.basename(path), f, "application/octet-stream")})


def names(client, key: str) -> list[str]:
    return [a["name"] for a in client.get("/v1/adapters", headers=auth(key)).json()["data"]]


def assert_refused(r, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "permission_error"


def test_the_issue_a_restricted_tenant_cannot_load_a_shared_file_by_path_under_a_new_name(setup) -> None:
    client, directory, allowed, _ = setup
    caps = shutil.copy(directory / "a.gguf", allowed / "caps.gguf")  # a config adapter t2 may not use
    assert greedy(client, "a", key="t2").status_code == 404
    before = names(client, "t2")
    assert_refused(load(client, "mycaps", caps, key="t2"), 403, "path_not_allowed")
    assert greedy(client, "mycaps", key="t2").status_code == 404
    assert names(client, "t2") == before


def test_loading_by_path_is_the_operators_unless_a_tenant_has_adapter_paths(setup, tiny_llama) -> None:
    client, directory, allowed, _ = setup
    fresh = adapter_file(tiny_llama, allowed / "fresh.gguf", 101)
    before = names(client, "t1")
    r = load(client, "fresh", fresh, key="t1")  # t1 may use every adapter, but has no adapter_paths
    assert_refused(r, 403, "path_not_allowed")
    assert "upload" in r.json()["error"]["message"] and str(allowed) not in r.text
    assert names(client, "t1") == before
    r = load(client, "fresh", fresh, key="operator")
    assert r.status_code == 200 and "added successfully" in r.text
    assert greedy(client, "fresh").status_code == 200  # shared, and t1 may use every adapter
    assert greedy(client, "fresh", key="t2").status_code == 404  # t2's ACL leaves it out


def test_a_tenant_loads_by_path_only_within_its_own_adapter_paths(setup, tiny_llama) -> None:
    client, directory, allowed, outside = setup
    mine = adapter_file(tiny_llama, allowed / "t2" / "mine.gguf", 111)
    beside = adapter_file(tiny_llama, allowed / "beside.gguf", 112)  # under allowed_paths, not under t2's
    elsewhere = adapter_file(tiny_llama, outside / "elsewhere.gguf", 113)
    (allowed / "t2" / "link.gguf").symlink_to(beside)
    (allowed / "t2" / "far.gguf").symlink_to(elsewhere)
    before = names(client, "t2")
    for path in (beside, allowed / "t2" / ".." / "beside.gguf", allowed / "t2" / "link.gguf", allowed / "t2" / "far.gguf",
                 elsewhere, directory / "b.gguf", "allowed/t2/../beside.gguf", "/etc/passwd"):
        r = load(client, "x", path, key="t2")
        assert_refused(r, 403, "path_not_allowed")
        assert "beside" not in r.text and "passwd" not in r.text and str(directory) not in r.text
    # t3's adapter_paths lie outside registry.allowed_paths: nothing there is read
    assert_refused(load(client, "x", elsewhere, key=T3_KEY), 403, "path_not_allowed")
    assert names(client, "t2") == before and greedy(client, "x", key="t2").status_code == 404
    # within its own directory (adapter_paths are relative to the config file, as lora_path is)
    assert load(client, "mine", mine, key="t2").status_code == 200
    assert greedy(client, "mine", key="t2").status_code == 200
    assert load(client, "mine2", "allowed/t2/mine.gguf", key="t2").status_code == 200
    assert client.get("/v1/adapters/mine", headers=auth("t2")).json()["shared"] is False
    assert greedy(client, "mine", key="t1").status_code == 404  # t2's own


def test_content_a_tenant_may_not_use_is_refused_under_any_name_by_path_or_upload(setup, tiny_llama) -> None:
    client, directory, allowed, _ = setup
    a_copy = shutil.copy(directory / "a.gguf", allowed / "t2" / "a-copy.gguf")
    b_copy = shutil.copy(directory / "b.gguf", allowed / "t2" / "b-copy.gguf")
    before = names(client, "t2")
    r = load(client, "acopy", a_copy, key="t2")  # its own directory, but the config's 'a'
    assert_refused(r, 403, "adapter_not_allowed")
    assert_refused(upload(client, "acopy", directory / "a.gguf", key="t2"), 403, "adapter_not_allowed")
    extra = adapter_file(tiny_llama, directory / "extra.gguf", 121)  # the operator's shared adapter
    assert upload_as_operator(client, "extra", extra).status_code == 201
    assert_refused(upload(client, "extra2", extra, key="t2"), 403, "adapter_not_allowed")
    assert names(client, "t2") == before
    assert greedy(client, "acopy", key="t2").status_code == 404
    # what its ACL allows ('b'), under a name of its own, it may; an unrestricted tenant may anything
    assert load(client, "bcopy", b_copy, key="t2").status_code == 200
    assert greedy(client, "bcopy", key="t2").status_code == 200
    assert upload(client, "acopy", directory / "a.gguf", key="t1").status_code == 201


def test_shared_content_the_operator_gives_a_restricted_tenant_is_never_served_to_it(setup) -> None:
    client, directory, _, _ = setup
    assert upload_as_operator(client, "sneaky", directory / "a.gguf", owner="t2").status_code == 201
    assert upload_as_operator(client, "okay", directory / "b.gguf", owner="t2").status_code == 201  # 'b': allowed
    t2 = auth("t2")
    unknown = greedy(client, "no-such-adapter", key="t2").json()["error"]
    r = greedy(client, "sneaky", key="t2")
    assert r.status_code == 404 and r.json()["error"]["code"] == unknown["code"]
    assert greedy(client, "okay", key="t2").status_code == 200
    stacked = {"prompt": PROMPT, "max_tokens": 2}
    refused = [
        client.post("/v1/completions", headers=t2, json={**stacked, "model": "b", "lora": [{"name": "sneaky"}]}),
        client.post("/v1/completions", headers=t2, json={**stacked, "model": "tiny",
                                                          "lora": [{"name": "b"}, {"name": "sneaky", "scale": 0.5}]}),
        client.post("/v1/chat/completions", headers=t2, json={"model": "sneaky", "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]}),
        client.post("/completion", headers=t2, json={"prompt": PROMPT, "n_predict": 2,
                                                      "lora": [{"name": "okay"}, {"name": "sneaky"}]}),
        client.post("/v1/messages", headers=t2, json={"model": "sneaky", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]}),
        client.post("/v1/responses", headers=t2, json={"model": "sneaky", "input": "hi", "max_output_tokens": 2}),
    ]
    assert [r.status_code for r in refused] == [404] * len(refused), [r.text for r in refused]
    assert "sneaky" not in [m["id"] for m in client.get("/v1/models", headers=t2).json()["data"]]
    assert "sneaky" not in [a["name"] for a in client.get("/lora-adapters", headers=t2).json()]
    assert "sneaky" not in names(client, "t2") and "okay" in names(client, "t2")
    assert client.get("/v1/adapters/sneaky", headers=t2).status_code == 404
    num_visible = len(client.get("/lora-adapters", headers=t2).json())
    r = client.post("/lora-adapters", headers=t2, json=[{"id": num_visible, "scale": 1.0}])
    assert r.status_code == 404
    assert client.get("/v1/adapters/sneaky", headers=OPERATOR, params={"owner": "t2"}).status_code == 200  # it is there
    assert client.delete("/v1/adapters/sneaky", headers=t2).status_code == 200  # and t2 may remove what it owns


def test_an_own_adapter_whose_content_becomes_a_forbidden_shared_one_stops_serving_and_its_default_scale_goes(
        setup, tiny_llama) -> None:
    client, directory, _, _ = setup
    t2 = auth("t2")
    later = adapter_file(tiny_llama, directory / "later.gguf", 131)
    base = greedy(client, "tiny", key="t2")
    assert upload(client, "later", later, key="t2").status_code == 201
    listing = client.get("/lora-adapters", headers=t2).json()
    index = next(a["id"] for a in listing if a["name"] == "later")
    assert client.post("/lora-adapters", headers=t2, json=[{"id": index, "scale": 1.0}]).status_code == 200
    with_default = greedy(client, "tiny", key="t2")
    assert with_default.json()["choices"][0]["logprobs"] != base.json()["choices"][0]["logprobs"]
    assert upload_as_operator(client, "later-shared", later).status_code == 201  # t2's ACL leaves it out
    assert greedy(client, "later", key="t2").status_code == 404
    assert_same_output(greedy(client, "tiny", key="t2"), base)  # its default scale no longer applies
    assert "later" not in [a["name"] for a in client.get("/lora-adapters", headers=t2).json()]


def test_the_operator_names_only_known_tenants_as_owners(setup, tiny_llama) -> None:
    client, directory, _, _ = setup
    r = upload_as_operator(client, "orphan", adapter_file(tiny_llama, directory / "orphan.gguf", 141), owner="nobody")
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
    assert upload(client, "x", directory / "orphan.gguf", key="t1").status_code == 201
    r = client.post("/v1/adapters", headers=auth("t1"), params={"owner": "t2"}, data={"name": "y"},
                    files={"file": ("f.gguf", b"x")})
    assert_refused(r, 403, "operator_only")


def test_run_time_tenants_take_adapter_paths_as_absolute_directories(setup, tiny_llama) -> None:
    client, directory, allowed, _ = setup
    (allowed / "rt").mkdir()
    tenant_id = f"rt-{uuid.uuid4().hex[:8]}"
    for bad in (["relative/dir"], "not-a-list", [str(allowed) + "\0"], [str(allowed)] * 65):
        r = client.post("/v1/tenants", headers=OPERATOR, json={"id": tenant_id, "adapter_paths": bad})
        assert r.status_code == 400 and "adapter_paths" in r.json()["error"]["message"], r.text
    r = client.post("/v1/tenants", headers=OPERATOR,
                    json={"id": tenant_id, "adapters": ["b"], "adapter_paths": [str(allowed / "rt")]})
    assert r.status_code == 201 and r.json()["adapter_paths"] == [str(allowed / "rt")]
    key = client.post(f"/v1/tenants/{tenant_id}/keys", headers=OPERATOR, json={}).json()["key"]
    inside = adapter_file(tiny_llama, allowed / "rt" / "rt.gguf", 151)
    assert load(client, "rt", inside, key=key).status_code == 200
    assert_refused(load(client, "rt2", allowed / "fresh.gguf", key=key), 403, "path_not_allowed")
    assert_refused(load(client, "rt3", shutil.copy(directory / "a.gguf", allowed / "rt" / "a.gguf"), key=key), 403,
                   "adapter_not_allowed")
    r = client.patch(f"/v1/tenants/{tenant_id}", headers=OPERATOR, json={"adapter_paths": []})
    assert r.status_code == 200 and r.json()["adapter_paths"] == []
    assert_refused(load(client, "rt4", inside, key=key), 403, "path_not_allowed")
    assert client.get("/v1/tenants/t2", headers=OPERATOR).json()["adapter_paths"] == ["allowed/t2"]
