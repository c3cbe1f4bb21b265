"""CORS as llama-server answers it (torch-free; docs/api.md#cors), for `http.cors_origins`.

An allowed origin is reflected with `Access-Control-Allow-Credentials: true` (what a browser page that sends
credentials needs: it refuses `*` then), but one that only `*` allows gets `*` and no credentials unless
`is_any_credentialed` (http.cors_credentials: true, or unset on a server of one tenant). `*` allows any
Origin value, URL or not (llama-server's default); `localhost` allows any http(s) origin on localhost,
127.0.0.1 or [::1], any port; anything else is an origin allowed as written. Every answer to a request
with an Origin says `Vary: Origin` (caches keep one answer per origin). A preflight is answered here, 200
with no body: for an allowed origin with llama-server's methods (and the one asked for, where a route of
ours takes it) and the headers it asks for; for another origin with no CORS header at all (the browser
then refuses the request itself), as llama-server does.

Ours rather than Starlette's CORSMiddleware: that one answers 400 to a preflight from an origin it does not
allow, and whether it reflects the origin of a credentialed request that carries no cookie (only an
Authorization header, as API clients do) depends on its version; here both are fixed, and tested
(tests/gateway/api/test_cors.py).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from starlette.datastructures import Headers, MutableHeaders

log = logging.getLogger(__name__)

ANY = "*"
LOCALHOST = "localhost"  # in http.cors_origins: every local origin
LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?", re.IGNORECASE)
METHODS = ("GET", "POST", "DELETE", "OPTIONS")  # llama-server's Access-Control-Allow-Methods
OTHER_METHODS = ("PATCH", "PUT", "HEAD")  # named too when a preflight asks for one (PATCH /v1/tenants/{id})
MAX_AGE_S = 600


def is_allowed(origin: str, origins: list[str]) -> bool:
    """Whether `origins` (http.cors_origins) lets a page of `origin` read the answers."""
    if LOCALHOST in origins and LOCAL_ORIGIN.fullmatch(origin) is not None:
        return True
    return ANY in origins or (origin in origins and origin != LOCALHOST)  # the word is not an origin


def _is_named(origin: str, origins: list[str]) -> bool:
    """Allowed otherwise than by `*`: listed, or local with `localhost`."""
    return is_allowed(origin, [o for o in origins if o != ANY])


def _allow_origin(origin: str, origins: list[str], is_credentialed: bool, is_any_credentialed: bool = True) -> dict[str, str]:
    if is_credentialed and (is_any_credentialed or _is_named(origin, origins)):
        return {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Credentials": "true"}
    return {"Access-Control-Allow-Origin": ANY if ANY in origins else origin}


def preflight_headers(request: Headers, origins: list[str], is_credentialed: bool,
                      is_any_credentialed: bool = True) -> dict[str, str]:
    """The headers of the answer to a preflight (an OPTIONS with Origin and Access-Control-Request-Method)."""
    origin = request["origin"]
    headers = {"Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"}
    if not is_allowed(origin, origins):
        log.info("CORS: preflight from %r refused (not in http.cors_origins)", origin[:200])
        return headers
    asked = request["access-control-request-method"].strip().upper()
    methods = METHODS + ((asked,) if asked in OTHER_METHODS else ())
    headers |= _allow_origin(origin, origins, is_credentialed, is_any_credentialed)
    headers |= {"Access-Control-Allow-Methods": ", ".join(methods), "Access-Control-Max-Age": str(MAX_AGE_S)}
    asked_headers = request.get("access-control-request-headers")
    if asked_headers:
        # reflected: a credentialed request's `*` means a header named "*" to the browser
        headers["Access-Control-Allow-Headers"] = asked_headers
    return headers


class Cors:
    """ASGI middleware: CORS for `origins` (the module's docstring); none: no CORS at all."""

    def __init__(self, app: Any, origins: list[str], is_credentialed: bool = True, is_any_credentialed: bool = True) -> None:
        self.app, self.origins, self.is_credentialed = app, origins, is_credentialed
        self.is_any_credentialed = is_any_credentialed  # an origin only `*` allows gets credentials too

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.origins:
            return await self.app(scope, receive, send)
        request = Headers(scope=scope)
        origin = request.get("origin")
        if origin is None:
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in request:
            return await self._preflight(request, send)

        async def with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                headers = MutableHeaders(scope=message)
                headers.add_vary_header("Origin")
                if is_allowed(origin, self.origins):
                    headers.update(_allow_origin(origin, self.origins, self.is_credentialed, self.is_any_credentialed))
            await send(message)

        await self.app(scope, receive, with_cors)

    async def _preflight(self, request: Headers, send: Any) -> None:
        headers = preflight_headers(request, self.origins, self.is_credentialed, self.is_any_credentialed)
        raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": [*raw, (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
