"""A request's affinity key (its adapter set and the first chunk of its prompt) and each
replica's rendezvous rank for a key: the highest-ranked replica is the key's favourite, and
adding or removing a replica moves only the keys it ranks first. `_rank` and `_ranks` are this
package's (its policies read them), not the gateway's."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from gateway.policy.routing.view import ReplicaView


def affinity_key(adapter_set_fingerprint: str, prompt_ids: Sequence[int], chunk_tokens: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(adapter_set_fingerprint.encode())
    h.update(b"\0")
    h.update(",".join(map(str, prompt_ids[:chunk_tokens])).encode())
    return h.digest()


def key_bits(key: bytes) -> int:
    """The 64 bits of an affinity key that ranks read (the key is a hash already)."""
    return int.from_bytes(key[:8], "big")


_MASK64 = (1 << 64) - 1
_replica_hashes: dict[str, int] = {}  # replica id -> its hash (a gateway sees a few hundred ids at most)


def _replica_hash(replica_id: str) -> int:
    h = _replica_hashes.get(replica_id)
    if h is None:
        if len(_replica_hashes) >= 1 << 16:
            _replica_hashes.clear()
        h = _replica_hashes[replica_id] = int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "big")
    return h


def _rank(key_hash: int, replica_id: str) -> int:
    """A replica's rendezvous weight for a key (its hash: `key_hash`): the two hashes combined and
    mixed by splitmix64's finalizer, so a request over hundreds of replicas hashes nothing per replica."""
    x = key_hash ^ _replica_hash(replica_id)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_VECTOR_FROM = 32  # pools this large are ranked with numpy (the same figures as _rank, several times faster)
_U27, _U30, _U31 = np.uint64(27), np.uint64(30), np.uint64(31)
_U_MIX1, _U_MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _ranks(key_hash: int, pool: Sequence[ReplicaView]) -> list[int]:
    """`_rank` of each replica of `pool`, in its order."""
    if len(pool) < _VECTOR_FROM:
        return [_rank(key_hash, r.replica_id) for r in pool]
    hashes = _replica_hashes
    x = np.array([hashes.get(r.replica_id) or _replica_hash(r.replica_id) for r in pool], dtype=np.uint64)
    x ^= np.uint64(key_hash)
    x = (x ^ (x >> _U30)) * _U_MIX1  # uint64 arithmetic wraps: the `& _MASK64` above
    x = (x ^ (x >> _U27)) * _U_MIX2
    return (x ^ (x >> _U31)).tolist()
