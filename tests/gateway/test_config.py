"""The deployment config: the shipped default loads; a bad file says which field is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

BASE = {"adapters": [{"name": "a", "path": "a.gguf"}], "shards": [{"name": "s", "adapters": ["a"]}]}


def test_the_default_config_loads_and_its_files_exist() -> None:
    config = load_config()
    assert [s.name for s in config.shards] == ["styles", "checks"]
    assert all(config.adapter_path(a.name).is_file() for a in config.adapters)
    assert {t.id for t in config.tenants} == {"demo", "acme"}


@pytest.mark.parametrize(("change", "message"), [
    ({"shards": []}, "shards: List should have at least 1 item"),
    ({"shards": [{"name": "s", "adapters": ["nope"]}]}, "shards[0] (s): unknown adapter 'nope'"),
    ({"shards": [{"name": "s", "adapters": ["a"], "replicas": 0}]}, "shards[0].replicas: Input should be greater than or equal to 1"),
    ({"adapters": [{"name": "a", "path": "a.gguf"}, {"name": "a", "path": "b.gguf"}]}, "adapters: 'a' appears twice"),
    ({"adapters": [{"name": "a", "path": "a.gguf"}, {"name": "b", "path": "b.gguf"}]}, "adapter 'b' is on no shard"),
    ({"tenants": [{"id": "t", "key_sha256": ["secret"]}]}, "tenants[0].key_sha256: 'secret' is not a hex SHA-256 digest"),
    ({"tenants": [{"id": "t", "key_sha256": ["0" * 64], "adapters": ["zz"]}]}, "tenants[0] (t): unknown adapter 'zz'"),
    ({"http": {"port": 70000}}, "http.port: Input should be less than or equal to 65535"),
    ({"routing": "fastest"}, "routing: Input should be 'affinity', 'random' or 'least_loaded'"),
    ({"colour": "blue"}, "colour: Extra inputs are not permitted"),
    ({"engine": {"dtype": "int8"}}, "engine.dtype"),
    ({"engine": {"decode_stall": 0}}, "engine.decode_stall: Input should be greater than 0"),
    ({"http": {"listener": "nginx"}}, "http.listener: Input should be 'gateway' or 'serve-proxy'"),
    ({"engine": {"threads": 2, "decode_threads": 4}}, "decode_threads must be between 1 and threads (2), got 4"),
])
def test_a_bad_field_is_named(change, message) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, **change}, ".", "serve.yaml")
    assert message in str(e.value) and str(e.value).startswith("serve.yaml: ")


def test_the_gateway_listens_itself_unless_told_serve_proxy() -> None:
    assert parse_config(BASE, ".").http.listener == "gateway"
    assert parse_config({**BASE, "http": {"listener": "serve-proxy"}}, ".").http.listener == "serve-proxy"


def test_the_prompt_budget_of_decoding_steps_reaches_the_engine() -> None:
    engine = parse_config({**BASE, "engine": {"prefill_while_decoding": 64, "decode_stall": 2.5}}, ".").engine.engine_config()
    assert (engine.prefill_while_decoding, engine.decode_stall) == (64, 2.5)
    assert parse_config({**BASE, "engine": {"decode_stall": None}}, ".").engine.engine_config().decode_stall is None


def test_decode_threads_reach_the_worker_unset_unless_given() -> None:
    assert parse_config(BASE, ".").worker_spec("s", threads=2).device.decode_threads is None  # all threads
    assert parse_config({**BASE, "engine": {"decode_threads": "auto"}}, ".").worker_spec("s").device.decode_threads == "auto"
    given = parse_config({**BASE, "engine": {"decode_threads": 1}}, ".").worker_spec("s", threads=2).device
    assert (given.threads, given.decode_threads) == (2, 1)


def test_unreadable_and_malformed_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("shards: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- just a list")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)


def test_tenants_file_and_redis_password_file_come_from_mounted_secrets(tmp_path) -> None:
    (tmp_path / "tenants.yaml").write_text('- {id: from-secret, key_sha256: ["' + "b" * 64 + '"]}\n')
    (tmp_path / "password").write_text("s3cret\n")
    config = parse_config({**BASE, "tenants": [{"id": "inline", "key_sha256": ["c" * 64]}], "tenants_file": "tenants.yaml",
                           "cache": {"redis_password_file": str(tmp_path / "password")}}, tmp_path)
    assert [t.id for t in config.tenants] == ["inline", "from-secret"] and config.tenants_file is None
    assert config.cache.redis_password() == "s3cret"
    with pytest.raises(ConfigError, match="tenants_file .*missing.yaml"):
        parse_config({**BASE, "tenants_file": "missing.yaml"}, tmp_path)
    with pytest.raises(ConfigError, match="redis_password_file: cannot read"):
        parse_config({**BASE, "cache": {"redis_password_file": str(tmp_path / "nope")}}, tmp_path).cache.redis_password()


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_deployment_config_loads(path) -> None:
    config = load_config(path)
    assert config.shards and all(config.adapter_path(name).is_file() for name in (a.name for a in config.adapters))
