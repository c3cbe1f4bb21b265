"""The gateway's side of the Ray cluster (torch-free): which cluster `loraplex serve` joins
(`ray_nodes`), the shard replicas as the gateway sees them (`pool`), its channel to each
(`channel`), and the HTTP listener of a gateway replica (`listener`). The deployment itself is
gateway/serve.py."""
