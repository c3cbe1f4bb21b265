"""What an API package hands the app (torch-free): its routers, the request bodies its POST routes
parse (for the OpenAPI document: the routes parse bodies themselves, to answer errors in their own
shape), and, where it is not OpenAI's, the error shape it answers in and the paths that answer so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter

from gateway.errors import GatewayError
from gateway.http.errors import openai_error


@dataclass(frozen=True)
class Api:
    name: str
    routers: tuple[APIRouter, ...]
    bodies: dict[str, Any] = field(default_factory=dict)  # POST path -> its pydantic body (or list[body])
    error_shape: Callable[[GatewayError], dict[str, Any]] = openai_error
    error_paths: tuple[str, ...] = ()  # path prefixes answered in `error_shape`; OpenAI's is everyone else's

    def answers(self, path: str) -> bool:
        return path.startswith(self.error_paths) if self.error_paths else False
