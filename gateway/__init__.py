"""loraplex gateway: the HTTP front door (tenants, routing). Never imports torch."""
