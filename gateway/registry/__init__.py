"""Adapters registered while the system runs: records shared by every gateway replica (`records`),
the content-addressed files the workers read (`store`) and those nothing needs any more (`garbage`),
what a tenant may see (`visibility`), and the registry that ties names, tenants, quotas and
placement together (`registry`)."""
