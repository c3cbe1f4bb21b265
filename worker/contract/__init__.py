"""What the gateway and a worker agree on (torch-free plain data, shared by both sides).

- `params`: a request's sampling parameters;
- `calls`: the call a worker gets (`WorkerCall`) and what it streams back (`Delta`);
- `spec`: what a shard replica is built from (`WorkerSpec`: model, pinned adapters,
  engine, device and cache settings), each subsystem's settings with its defaults.
"""
