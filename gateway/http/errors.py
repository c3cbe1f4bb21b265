"""A `GatewayError` in the OpenAI API's error shape, `{"error": {"message", "type", "code"}}`: the
shape of every API but those that name their own (torch-free)."""

from __future__ import annotations

from typing import Any

from gateway.errors import GatewayError

OPENAI_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error",
}


def openai_error(error: GatewayError) -> dict[str, Any]:
    kind = error.kind or OPENAI_TYPES.get(error.status, "error")
    return {"error": {"message": error.message, "type": kind, "code": error.code, **error.details}}
