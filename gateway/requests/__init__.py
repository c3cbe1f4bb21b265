"""A request's path between HTTP and the shard replicas (torch-free): admitted (`admission`: the
tenant's adapters, limits and quota reservation), routed, run and failed over (`dispatch`), traced
(`tracing`); the gateway's health (`health`); the Responses API's stored responses
(`response_store`)."""
