"""Seeds that every process derives alike: the project's only way to make shared or per-worker randomness."""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``repr`` of the parts, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
