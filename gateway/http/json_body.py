"""A request's JSON body (torch-free): read to at most the configured size, parsed with every
string checked as Unicode and nesting bounded, then validated against its pydantic model; each
fault is a 400 (413 for size) naming what is wrong."""

from __future__ import annotations

import functools
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from gateway.errors import GatewayError

MAX_JSON_DEPTH = 32


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """A request's body, 413 past `limit_bytes` (the header's claim, or what is actually sent)."""
    if int(request.headers.get("content-length") or 0) > limit_bytes:
        raise GatewayError(413, f"request body over {limit_bytes} bytes", "body_too_large")
    body = bytearray()
    async for part in request.stream():  # stop reading at the limit, whatever the header said
        body += part
        if len(body) > limit_bytes:
            raise GatewayError(413, f"request body over {limit_bytes} bytes", "body_too_large")
    return bytes(body)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def load_json(body: bytes) -> Any:
    """A request body's JSON: 400 when malformed, nested deeper than MAX_JSON_DEPTH, holding
    NaN or Infinity, or a string that is not valid Unicode (a lone surrogate)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise GatewayError(400, f"malformed JSON body: {e}", "invalid_json") from e
    except RecursionError as e:
        raise GatewayError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json") from e
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value)
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise GatewayError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_unicode(key)
                stack.append((item, depth + 1))
    return data


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GatewayError(400, f"a string in the body is not valid Unicode (a lone surrogate U+{ord(text[e.start]):04X})",
                       "invalid_json") from e


@functools.cache
def _adapter(model: Any) -> TypeAdapter:
    is_model = isinstance(model, type) and issubclass(model, BaseModel)  # a model has its own config
    return TypeAdapter(model, config=None if is_model else ConfigDict(strict=True))


def parse(model: Any, data: Any) -> Any:
    """Validate a JSON body against a model (or a list of one); a bad one is a 400 naming the field."""
    try:
        return _adapter(model).validate_python(data)
    except ValidationError as e:
        err = e.errors()[0]
        internal = ("function-", "list[", "str", "int")  # pydantic's names of validators and union members
        where = ".".join(str(p) for p in err["loc"] if not isinstance(p, str) or not p.startswith(internal))
        message = err["msg"].removeprefix("Value error, ")
        raise GatewayError(400, f"{where}: {message}" if where else message, "invalid_value") from e
