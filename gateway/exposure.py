"""Who a deployment lets in, checked when its config is read (torch-free).

Nobody by inference: `auth: none` (one anonymous tenant) is said in the config, never concluded from
an empty store; with `auth: keys` (the default) a config needs tenants or an operator key, unless its
state store is durable (operator keys made at run time may be all there is). And nobody by accident:
beyond loopback, the public example keys of deploy/serve.yaml, or no keys at all, would let anyone in
who reaches it, so that is refused unless the operator says it is meant (`http.allow_insecure_bind`,
`loraplex serve --allow-insecure-bind`; checked again once `--host` has moved it)."""

from __future__ import annotations

import hashlib
import ipaddress

EXAMPLE_KEYS = ("sk-loraplex-demo", "sk-loraplex-acme", "sk-loraplex-operator")  # deploy/serve.yaml's: public
EXAMPLE_KEY_DIGESTS = frozenset(hashlib.sha256(k.encode()).hexdigest() for k in EXAMPLE_KEYS)


def auth_error(auth: str, has_tenants: bool, has_operator_keys: bool, is_ephemeral: bool) -> str | None:
    """Why `auth` with the config's tenants and operator keys cannot be (None: it can)."""
    if auth == "none" and has_tenants:
        return "auth: none serves everyone anonymously, and tenants are configured: remove the tenants or use auth: keys"
    if auth == "keys" and not has_tenants and not has_operator_keys and is_ephemeral:
        return ("no tenants and no operator key: nobody could call this deployment; add tenants or an operator key "
                "(operator_key_sha256, operator_key_file), or set auth: none for an open one")
    return None


def is_loopback(host: str) -> bool:
    """`localhost`, or an address (not a name, which could resolve anywhere) in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_error(host: str, is_allowed: bool, auth: str, key_digests: set[str]) -> str | None:
    """Why listening on `host` with `auth` and these keys (hex SHA-256) is refused; None when it is not
    (loopback, keys of the operator's own, or `is_allowed`)."""
    if is_loopback(host) or is_allowed:
        return None
    examples = key_digests & EXAMPLE_KEY_DIGESTS
    if auth == "none":
        why = "with auth: none (no keys at all)"
    elif examples:
        why = f"with {len(examples)} of the public example keys (deploy/serve.yaml's sk-loraplex-*)"
    else:
        return None
    return (f"http.host {host} listens beyond loopback {why}: anyone who reaches it gets in; use keys of your own, "
            "or set http.allow_insecure_bind: true (--allow-insecure-bind) if that is meant")
