"""Chained hashes of full KV blocks: a block's hash covers its tokens and all before them."""

from __future__ import annotations

import hashlib
from array import array

_ROOT = b"duoserve-kv-root"


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    # A 128-bit digest: a collision would silently serve another prompt's KV, so no
    # 64-bit Python hash here.
    digest = hashlib.blake2b(parent_hash or _ROOT, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: list[int], block_size: int) -> None:
    """Append the hashes of the blocks of `token_ids` that became full since the last call."""
    num_full = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full):
        parent = block_hashes[index - 1] if index else None
        start = index * block_size
        block_hashes.append(hash_block(parent, token_ids[start : start + block_size]))
