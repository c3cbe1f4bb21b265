"""loraplex prefix cache (Redis-backed KV reuse). Never imports torch."""
