"""Adapters registered while the system runs: records shared by every gateway replica (`records`),
the content-addressed files the workers read (`store`) and those nothing needs any more (`garbage`),
what a tenant may see (`visibility`), where pins go over the replicas there are now
(`live_placement`), and the registry that ties names, tenants, quotas and placement together
(`registry`). Its settings, the config's `registry` section, are gateway/registry_settings.py's."""
