"""The gateway's decisions as pure functions over plain data, with no I/O: which replica a
request goes to (`routing`), which adapters each worker pins (`placement`), how many replicas a
shard should have (`autoscale`)."""
