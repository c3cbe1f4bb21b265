"""Adapters registered while the system runs (issue 18): records shared by every gateway
replica (`records`), the content-addressed files the workers read (`store`), and the
registry that ties names, tenants, quotas and placement together (`registry`)."""
