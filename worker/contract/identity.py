"""The identities on a request's path, one type each (torch-free; docs/architecture.md#identities).

- `AdapterName`: what a tenant calls an adapter (the gateway's registry and ACLs). Names
  never cross the wire: a worker knows adapters by content only.
- `Fingerprint`: an adapter's content hash (docs/architecture.md#fingerprints), how the gateway routes and how a
  worker holds it; two names of the same file are one fingerprint.
- `AdapterSlot`: where a worker holds one adapter's weights (its index in the LoRA stack).
- `SeqSlot`: one sequence's KV cache slot in a worker's engine.

A set of enabled adapters is always a map from one of these to a scale, named for its key:
`scales_by_name` (the tenant's request), `scales_by_fingerprint` (the `WorkerCall`, routing),
`scales_by_slot` (the engine's request). Each stage's input has its own type; the next
stage never re-derives what the last one decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NewType

AdapterName = NewType("AdapterName", str)
Fingerprint = NewType("Fingerprint", str)
AdapterSlot = NewType("AdapterSlot", int)
SeqSlot = NewType("SeqSlot", int)

ScalesByName = Mapping[AdapterName, float]
ScalesByFingerprint = Mapping[Fingerprint, float]
ScalesBySlot = Mapping[AdapterSlot, float]
