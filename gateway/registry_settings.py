"""The serve config's `registry` section (gateway/config.py's ServeConfig holds it): adapters registered at run
time, where their files are kept, the limits, and how often the registry re-plans (torch-free)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cache.blobs import parse_store_url


class RegistrySettings(BaseModel):
    """Adapters registered at run time (gateway/registry/): where their files are kept and the limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the adapter store (cache/blobs.py): s3://bucket/prefix (endpoint and credentials: the AWS variables), file:///path
    # (one node, or a ReadWriteMany volume); None: store_dir itself (one machine)
    store_url: str | None = None
    store_dir: str = "~/.cache/loraplex/adapters"  # this node's copies of the store's adapter files (the store, without store_url)
    allowed_paths: list[str] = Field(default_factory=list)  # directories load_lora_adapter's lora_path may name
    max_upload_bytes: int = Field(512 << 20, ge=1024)  # one upload's body (adapters are MBs)
    max_adapters_per_worker: int = Field(1024, ge=1)
    copies: int = Field(2, ge=1)  # replicas a new adapter is pinned on (where there are that many)
    poll_interval_s: float = Field(1.0, gt=0, le=60)  # how soon the other gateway replicas see a change
    resync_interval_s: float = Field(10.0, gt=0)  # every worker is sent its pins again (a restarted one gets them back)
    load_timeout_s: float = Field(60.0, gt=0)  # a new adapter must be loaded by a worker within this
    garbage_age_s: float = Field(300.0, ge=0)  # an unreferenced file is deleted once this old and no worker holds it
    replan_interval_s: float = Field(60.0, gt=0)  # registered adapters' pins follow the traffic this often

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, url: str | None) -> str | None:
        if not url:
            return None
        parse_store_url(url)
        return url
