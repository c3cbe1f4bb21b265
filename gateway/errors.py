"""The error every part of the gateway raises when it refuses or fails a request (torch-free).

It carries what any API needs to answer it: an HTTP status, a message a client can act on, a
stable code, headers (`Retry-After`) and any extra fields. The HTTP edge maps it to each API's
error shape (gateway/http/errors.py for OpenAI's, gateway/api/anthropic/formats.py for
Anthropic's); nothing below the edge knows those shapes.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """A refused or failed request: `status`, `message`, `code`, with `kind` (the error's `type`
    where it is not the status's) and `details` (more fields of the answer's `error`)."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.kind, self.details = kind, details
        self.num_generated_tokens: int | None = None  # set when the request ran before it failed (its usage counts)
