"""The HTTP edge's settings (the serve config's `http` section, gateway/config.py), and the Ray
label selector type that it and the shards use for the nodes they run on."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from gateway.policy.nodes import selector_error


def _label_selector(selector: dict[str, str]) -> dict[str, str]:
    error = selector_error(selector)
    if error is not None:
        raise ValueError(error)
    return selector


NodeLabels = Annotated[dict[str, str], AfterValidator(_label_selector)]  # a Ray label selector: value, !value, in(a, b)


class HTTPSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_tokens_default: int = Field(256, ge=1)  # requests without max_tokens (n_predict), at most what fits the context
    request_timeout_s: float = Field(300.0, gt=0, le=24 * 3600)  # each request's deadline (a client may ask less)
    gateway_replicas: int = Field(1, ge=1, le=64)  # ingress replicas, sharing the registry and rate limits
    # who listens on the port: each gateway replica itself (gateway/cluster/listener.py), or Ray Serve's proxies, which
    # pass every request to a gateway replica over Ray (one hop more; what a KubeRay RayService's Service expects)
    listener: Literal["gateway", "serve-proxy"] = "gateway"
    # the Ray node labels of the nodes that take traffic: the gateway replicas run there, at most one a node
    # (one listener per node, as Serve's proxies do); empty: wherever Ray puts them
    node_labels: NodeLabels = Field(default_factory=dict)
    # origins browsers may call the API from (CORS, gateway/http/cors.py): ["*"] any, llama-server's default;
    # "localhost": any http(s) origin on this machine; an origin as scheme://host[:port]; []: none
    cors_origins: list[str] = Field(default_factory=lambda: ["*"])
    # Access-Control-Allow-Credentials: true, the origin reflected. true: for every allowed origin, `*` too (llama-server's);
    # false: never (`*`); None: true, but where several tenants share the server (several, or an operator key) an origin
    # only `*` allows gets `*` with no credentials (a page sends its own key; a browser's cookies are not for any site)
    cors_credentials: bool | None = None
    allow_insecure_bind: bool = False  # listen beyond loopback with the example keys or auth: none (gateway/exposure.py)
    # a request's own `chat_template` (code its sender writes, rendered in the bounded sandbox): off, a 400
    allow_request_chat_template: bool = False
    # what a `model` that is neither the base (its name) nor an adapter of the caller's means: error, a 404 (each
    # tenant sees only its own names); base, the base model, as llama-server serves its one model whatever `model` says
    unknown_model: Literal["error", "base"] = "error"

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, values: list[str]) -> list[str]:
        for value in values:
            if value not in ("*", "localhost", "null") and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+", value):
                raise ValueError(f"{value!r} is not an origin: scheme://host[:port] with no path (as a browser sends "
                                 "it: no trailing slash), '*' (any) or 'localhost' (any origin on this machine)")
        return values
