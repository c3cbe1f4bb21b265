"""Where a shard replica keeps the adapters it serves: in tiers, each with a budget (ResidencySettings;
none: no limit, and every adapter served stays on the device).

- device: in one of the runner's adapter slots, what a pass can use (`device`);
- host: read, scaled, a DoRA's norms made, ready to copy (`host`);
- disk: this node's copy of the store's file (`disk`);
- the store: the tier below (cache/blobs.py).

`residency` (the `Residency`: which adapters the replica serves, changed while it runs, and a request's
adapters leased on the device) builds on `promotion` (bringing one up to the device while other requests
keep stepping), the tiers, `eviction` (which adapters leave the device for room: pure), `sizes` (an
adapter's device bytes), `stats` (the tiers' counters) and `memory` (what keeps the process within the
tiers' bytes: a fixed pool of reader threads, bounded malloc arenas, a trim after evictions). The
deploy-time adapters (the operator's pins) never leave the device; the host and disk tiers drop their
least recently used copies past their budgets.
"""
