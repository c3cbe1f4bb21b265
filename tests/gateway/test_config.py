"""The deployment config: the shipped default loads; a bad file says which field is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache.l2 import RedisConfig, read_password_file
from cache.prefix import PrefixCacheConfig
from gateway.config import ConfigError, ServeConfig, load_config, parse_config
from gateway.policy.autoscale import AutoscalingSettings
from gateway.policy.routing import RoutingSettings
from worker.contract.spec import DeviceSettings, EngineConfig

BASE = {"adapters": [{"name": "a", "path": "a.gguf"}], "shards": [{"name": "s", "adapters": ["a"]}], "auth": "none",
        "state": {"ephemeral": True}}


def test_the_default_config_loads_and_its_files_exist() -> None:
    config = load_config()
    assert [s.name for s in config.shards] == ["styles", "checks"]
    assert all(config.adapter_path(a.name).is_file() for a in config.adapters)
    assert {t.id for t in config.tenants} == {"demo", "acme"}


@pytest.mark.parametrize(("change", "message"), [
    ({"shards": []}, "shards: List should have at least 1 item"),
    ({"shards": [{"name": "s", "adapters": ["nope"]}]}, "shards[0] (s): unknown adapter 'nope'"),
    ({"shards": [{"name": "s", "adapters": ["a"], "replicas": 0}]},
     "shards[0].replicas: Input should be greater than or equal to 1"),
    ({"adapters": [{"name": "a", "path": "a.gguf"}, {"name": "a", "path": "b.gguf"}]}, "adapters: 'a' appears twice"),
    ({"adapters": [{"name": "a", "path": "a.gguf"}, {"name": "b", "path": "b.gguf"}]}, "adapter 'b' is on no shard"),
    ({"tenants": [{"id": "t", "key_sha256": ["secret"]}]},
     "tenants[0].key_sha256: 'secret' is not a hex SHA-256 digest"),
    ({"tenants": [{"id": "t", "key_sha256": ["0" * 64], "adapters": ["zz"]}]}, "tenants[0] (t): unknown adapter 'zz'"),
    ({"http": {"port": 70000}}, "http.port: Input should be less than or equal to 65535"),
    ({"http": {"listener": "nginx"}}, "http.listener: Input should be 'gateway' or 'serve-proxy'"),
    ({"colour": "blue"}, "colour: Extra inputs are not permitted"),
    # the subsystems' own dataclasses: their fields' types, unknown keys, their __post_init__ checks
    ({"engine": {"num_seq_slots": "many"}}, "engine.num_seq_slots: Input should be a valid integer"),
    ({"engine": {"num_seq_slots": 0}}, "engine: num_seq_slots must be >= 1, got 0"),
    ({"engine": {"num_seq_slots": 8, "max_step_tokens": 4}},
     "engine: max_step_tokens (4) must be at least num_seq_slots"),
    ({"engine": {"decode_stall": 0}}, "engine: decode_stall must be > 0"),
    ({"engine": {"colour": "blue"}}, "engine.colour: Extra inputs are not permitted"),
    ({"device": {"dtype": "int8"}}, "device: dtype must be one of float32, float16, bfloat16, got 'int8'"),
    ({"device": {"weights": "q8"}}, "device: weights must be one of"),
    ({"device": {"threads": 2, "decode_threads": 4}}, "decode_threads must be between 1 and threads (2), got 4"),
    ({"device": {"colour": "blue"}}, "device.colour: Extra inputs are not permitted"),
    ({"cache": {"chunk_tokens": 0}}, "cache: chunk_tokens must be >= 1, got 0"),
    ({"cache": {"ttl_s": "long"}}, "cache.ttl_s: Input should be a valid integer"),
    ({"cache": {"ttl_s": 0}}, "cache: ttl_s must be >= 1, got 0"),
    ({"cache": {"redis_url": "http://cache:6379"}}, "cache: redis url must start with redis://"),
    ({"cache": {"colour": "blue"}}, "cache.colour: Extra inputs are not permitted"),
    ({"routing": {"policy": "fastest"}}, "routing: unknown routing policy 'fastest' (known: affinity, random, least_loaded)"),
    ({"routing": {"policy": "affinity", "eps": 0}}, "routing: eps and half_life_s must be > 0"),
    ({"routing": {"colour": "blue"}}, "routing.colour: Extra inputs are not permitted"),
    # spellings of another day, refused by name; what worker_spec sets
    ({"engine": {"num_slots": 4}}, "engine.num_slots: Extra inputs are not permitted"),
    ({"engine": {"dtype": "float16"}}, "engine.dtype: Extra inputs are not permitted"),
    ({"routing": "affinity"}, "routing: Input should be a dictionary"),
    ({"cache": {"redis": {"url": "redis://cache:6379/0"}}}, "cache.redis: give redis_url, key_prefix"),
    ({"device": {"device": "cuda:1"}}, "device.device: chosen per shard"),
    ({"engine": {"is_multi_tenant": True}}, "engine.is_multi_tenant: follows from the tenants"),
])
def test_a_bad_field_is_named(change, message) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, **change}, ".", "serve.yaml")
    assert message in str(e.value) and str(e.value).startswith("serve.yaml: ")


def test_the_gateway_listens_itself_unless_told_serve_proxy() -> None:
    assert parse_config(BASE, ".").http.listener == "gateway"
    assert parse_config({**BASE, "http": {"listener": "serve-proxy"}}, ".").http.listener == "serve-proxy"


def test_each_section_is_its_subsystems_settings_with_their_defaults() -> None:
    config = parse_config(BASE, ".")
    assert (config.engine, config.device, config.routing) == (EngineConfig(), DeviceSettings(), RoutingSettings())
    assert config.cache == PrefixCacheConfig(redis=RedisConfig())  # Redis on by default


def test_each_section_takes_its_own_settings() -> None:
    new = parse_config({**BASE, "routing": {"policy": "least_loaded"},
                        "engine": {"num_seq_slots": 4, "max_step_tokens": 64},
                        "device": {"dtype": "bfloat16", "threads": 2, "decode_threads": "auto"}}, ".")
    assert (new.engine.num_seq_slots, new.device.dtype, new.routing.policy) == (4, "bfloat16", "least_loaded")
    assert new.device == DeviceSettings(dtype="bfloat16", threads=2, decode_threads="auto")


def test_the_routing_section_takes_every_routing_setting() -> None:
    routing = parse_config({**BASE, "routing": {"eps": 0.5, "max_attempts": 3}}, ".").routing
    assert routing == RoutingSettings(policy="affinity", eps=0.5, max_attempts=3)


def test_the_flat_cache_keys_become_the_prefix_cache_and_its_redis() -> None:
    cache = parse_config({**BASE, "cache": {"redis_url": "rediss://cache:6380/1", "key_prefix": "lp", "ttl_s": 60,
                                            "timeout_s": 0.5, "redis_password_file": "/secret/password",
                                            "chunk_tokens": 16, "l1_bytes": 1024, "write_pause": 2}}, ".").cache
    assert cache == PrefixCacheConfig(chunk_tokens=16, l1_bytes=1024, write_pause=2.0, redis=RedisConfig(
        url="rediss://cache:6380/1", key_prefix="lp", ttl_s=60, timeout_s=0.5, password_file="/secret/password"))
    assert parse_config({**BASE, "cache": {"redis_url": None, "key_prefix": "lp"}}, ".").cache.redis is None


@pytest.mark.parametrize("change", [{}, {"cache": {"redis_url": None}},
                                    {"routing": {"policy": "random"}, "engine": {"num_seq_slots": 2}, "device": {"threads": 1},
                                     "cache": {"redis_url": "redis://cache:6379/0", "redis_password_file": "/p"}}])
def test_a_dump_has_the_files_shape_and_validates_again(change) -> None:
    """What the Serve ingress gets (gateway/serve.py: build)."""
    config = parse_config({**BASE, **change}, ".")
    data = config.model_dump()
    assert "redis" not in data["cache"] and "redis_url" in data["cache"] and "is_multi_tenant" not in data["engine"]
    assert ServeConfig.model_validate(data) == config


def test_the_prompt_budget_of_decoding_steps_reaches_the_engine() -> None:
    config = parse_config({**BASE, "engine": {"prefill_while_decoding": 64, "decode_stall": 2.5}}, ".")
    engine = config.worker_spec("s").engine
    assert (engine.prefill_while_decoding, engine.decode_stall) == (64, 2.5)
    assert parse_config({**BASE, "engine": {"decode_stall": None}}, ".").engine.decode_stall is None


def test_the_top_level_speculative_section_reaches_every_engine_and_is_off_by_default() -> None:
    assert not parse_config(BASE, ".").worker_spec("s").engine.speculative.is_on
    config = parse_config({**BASE, "speculative": {"method": "ngram", "max_draft": 3}}, ".")
    speculative = config.worker_spec("s").engine.speculative
    assert speculative.is_on and speculative.max_draft == 3
    assert parse_config(config.model_dump(), ".").worker_spec("s").engine.speculative == speculative  # a dump loads again
    for bad, message in (({"method": "eagle"}, "speculative.method must be one of none, ngram"),
                         ({"method": "ngram", "max_draft": 0}, "max_draft must be between 1 and 16"),
                         ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min <= ngram_max")):
        with pytest.raises(ConfigError, match=message):
            parse_config({**BASE, "speculative": bad}, ".")
    with pytest.raises(ConfigError, match="engine.speculative: is the top-level speculative section"):
        parse_config({**BASE, "engine": {"speculative": {"method": "ngram"}}}, ".")


def test_decode_threads_reach_the_worker_unset_unless_given() -> None:
    assert parse_config(BASE, ".").worker_spec("s", threads=2).device.decode_threads is None  # all threads
    auto = parse_config({**BASE, "device": {"decode_threads": "auto"}}, ".")
    assert auto.worker_spec("s").device.decode_threads == "auto"
    given = parse_config({**BASE, "device": {"decode_threads": 1}}, ".").worker_spec("s", threads=2).device
    assert (given.threads, given.decode_threads) == (2, 1)


def test_the_worker_spec_decides_the_device_threads_and_tenancy(tmp_path) -> None:
    shards = [{"name": "cpu", "adapters": ["a"]}, {"name": "gpu", "adapters": ["a"], "num_gpus": 1}]
    tenants = [{"id": t, "key_sha256": [c * 64]} for t, c in (("t1", "a"), ("t2", "b"))]
    config = parse_config({**BASE, "shards": shards, "device": {"dtype": "float16"}}, tmp_path)
    cpu, gpu = config.worker_spec("cpu", threads=3), config.worker_spec("gpu")
    assert (cpu.device.device, cpu.device.threads, cpu.device.dtype) == ("cpu", 3, "float16")
    assert (gpu.device.device, gpu.device.dtype) == ("cuda", "float16")
    assert cpu.adapter_paths == (str(tmp_path / "a.gguf"),) and cpu.cache is config.cache
    assert parse_config({**BASE, "device": {"threads": 2}}, ".").worker_spec("s", threads=8).device.threads == 2
    assert not cpu.engine.is_multi_tenant
    assert parse_config({**BASE, "auth": "keys", "tenants": tenants}, ".").worker_spec("s").engine.is_multi_tenant
    operated = parse_config({**BASE, "auth": "keys", "operator_key_sha256": ["0" * 64]}, ".")  # tenants may come at run time
    assert operated.worker_spec("s").engine.is_multi_tenant


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
    config = parse_config({**BASE, "auth": "keys", "tenants": [{"id": "inline", "key_sha256": ["c" * 64]}],
                           "tenants_file": "tenants.yaml",
                           "cache": {"redis_password_file": str(tmp_path / "password")}}, tmp_path)
    assert [t.id for t in config.tenants] == ["inline", "from-secret"] and config.tenants_file is None
    assert read_password_file(config.cache.redis.password_file) == "s3cret"  # as the workers' and gateway's clients do
    with pytest.raises(ConfigError, match="tenants_file .*missing.yaml"):
        parse_config({**BASE, "tenants_file": "missing.yaml"}, tmp_path)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_deployment_config_loads(path) -> None:
    config = load_config(path)
    assert config.shards and all(config.adapter_path(name).is_file() for name in (a.name for a in config.adapters))


def _shard(**fields: object) -> dict:
    return {**BASE, "shards": [{"name": "s", "adapters": ["a"], **fields}]}


def test_a_shard_scales_within_its_autoscaling_bounds_and_replicas_is_the_max() -> None:
    shard = parse_config(_shard(autoscaling={"min_replicas": 0, "max_replicas": 3, "ttft_slo_s": 2.0}), ".").shards[0]
    assert shard.replicas == 3  # deployed until Serve's autoscaling is wired
    assert shard.settings() == AutoscalingSettings(min_replicas=0, max_replicas=3, ttft_slo_s=2.0)
    alone = parse_config(_shard(replicas=4, autoscaling={"min_replicas": 1}), ".").shards[0]
    assert (alone.replicas, alone.settings().max_replicas) == (4, 4)  # replicas given alone: the max
    fixed = parse_config(_shard(replicas=2), ".").shards[0]
    assert fixed.autoscaling is None and fixed.settings() == AutoscalingSettings.fixed(2)
    config = parse_config(_shard(autoscaling={"max_replicas": 5}), ".")
    assert ServeConfig.model_validate(config.model_dump()) == config


@pytest.mark.parametrize(("fields", "message"), [
    ({"replicas": 2, "autoscaling": {"max_replicas": 3}}, "shards[0]: replicas (2) must equal autoscaling.max_replicas (3)"),
    ({"autoscaling": {"min_replicas": 4, "max_replicas": 3}}, "shards[0].autoscaling: min_replicas (4) must be <= max_replicas (3)"),
    ({"autoscaling": {"max_replicas": 0}}, "shards[0].autoscaling: min_replicas must be >= 0 and max_replicas >= 1"),
    ({"autoscaling": {"max_replicas": 300}}, "shards[0]: autoscaling.max_replicas must be <= 256"),
    ({"autoscaling": {"max_replicas": 2, "target_utilization": 1.5}}, "shards[0].autoscaling: target_utilization must be in (0, 1]"),
    ({"autoscaling": {"max_replicas": 2, "upscale_delay_s": -1}}, "shards[0].autoscaling: upscale_delay_s, downscale_delay_s"),
    ({"autoscaling": {"max_replicas": 2, "cooldown": 5}}, "shards[0].autoscaling.cooldown: Extra inputs are not permitted"),
])
def test_a_bad_autoscaling_section_is_named(fields, message) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(_shard(**fields), ".", "serve.yaml")
    assert message in str(e.value)
