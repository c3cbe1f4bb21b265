"""The loraplex gateway (torch-free but for what a replica runs): the HTTP front door and control plane.

From the bottom up: pure decisions (`policy`); the deployment's config, errors, catalog, metrics,
state store and tool calls (modules here); the replicas as the gateway sees them (`cluster`); the
adapter registry (`registry`); tenants, keys, usage and limits (`tenancy`); a request's path
(`requests`); the composition root (`compose`); what every API shares (`http`); one package per
API (`api`); and on top the Ray Serve deployment (`serve`), the command line (`cli`) and the load
tester (`loadtest`). docs/architecture.md walks through them.
"""
