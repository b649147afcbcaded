"""Content-addressed lookup of computed, full device blocks (automatic prefix caching).

A full block is keyed by a chained hash: ``hash_block_tokens(parent_hash,
token_ids)``, where ``parent_hash`` is the key of the block before it in the
sequence (``None`` for the first block). Equal keys therefore mean equal
prefixes up to and including the block. The hash is a 128-bit BLAKE2b digest;
on a lookup the block's own token ids are also compared with the stored ones,
so a collision never returns K/V of other tokens for this block.

Invariants (checked by ``check_invariants``):

- ``hash -> entry`` and ``block -> hash`` are inverse maps: a block is
  registered under at most one hash and a hash names at most one block.
- Only blocks whose K/V are computed are registered (the block manager's job:
  it registers in ``mark_blocks_computed`` and ``pin_prefix``, never at allocation).
- The evictable blocks are registered blocks with no reference left, in least
  recently used order (first = evicted first). Their K/V stay valid until evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """Chained key of a full block: digest of the parent's key and this block's tokens."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def iter_block_hashes(token_ids: Sequence[int], block_size: int, stop: int, start: int = 0,
                      parent_hash: Optional[bytes] = None) -> Iterator[tuple[bytes, tuple[int, ...]]]:
    """(key, token ids) of full blocks ``start .. stop - 1``, lazily; ``parent_hash``
    is the key of block ``start - 1``."""
    for i in range(start, stop):
        block_tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent_hash = hash_block_tokens(parent_hash, block_tokens)
        yield parent_hash, block_tokens


@dataclass(frozen=True)
class _Entry:
    block: int
    token_ids: tuple[int, ...]


class PrefixCache:
    """Maps chained block hashes to device blocks; keeps the LRU order of evictable ones."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, _Entry] = {}
        self._hash_of_block: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable_blocks(self) -> Iterator[int]:
        """Evictable blocks, least recently used first."""
        return iter(self._evictable)

    def registered_blocks(self) -> Iterator[int]:
        return iter(self._hash_of_block)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of_block

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    # ---- lookup and registration ---------------------------------------------
    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Optional[int]:
        """The block holding exactly these tokens after this prefix, or None."""
        entry = self._by_hash.get(block_hash)
        if entry is None or entry.token_ids != token_ids:
            return None
        return entry.block

    def match(self, token_ids: Sequence[int], block_size: int, max_blocks: int,
              root: Optional[bytes] = None) -> tuple[list[int], list[bytes]]:
        """The cached blocks holding the leading full blocks of ``token_ids`` (up to
        ``max_blocks``, stopping at the first miss), and their keys; ``root`` is the first
        block's parent key (a layer group's own, or None)."""
        hits: list[int] = []
        hashes: list[bytes] = []
        if self._by_hash:
            for block_hash, block_tokens in iter_block_hashes(token_ids, block_size, max_blocks, parent_hash=root):
                block = self.lookup(block_hash, block_tokens)
                if block is None:
                    break
                hits.append(block)
                hashes.append(block_hash)
        return hits, hashes

    def register(self, block_hash: bytes, token_ids: tuple[int, ...], block: int) -> bool:
        """Enter a computed block. Returns False (and changes nothing) when the hash
        already names a block: the first copy of a content stays the cached one."""
        if block_hash in self._by_hash:
            return False
        if block in self._hash_of_block:
            raise ValueError(f"block {block} is already registered under another hash")
        self._by_hash[block_hash] = _Entry(block, token_ids)
        self._hash_of_block[block] = block_hash
        return True

    def deregister(self, block: int) -> None:
        """Forget a block (it must not be evictable: evict it instead)."""
        if block in self._evictable:
            raise ValueError(f"block {block} is evictable: evict it rather than deregister it")
        del self._by_hash[self._hash_of_block.pop(block)]

    # ---- eviction --------------------------------------------------------------
    def park(self, block: int) -> None:
        """The last reference to a registered block is gone: it becomes the most
        recently used evictable block."""
        if block not in self._hash_of_block:
            raise ValueError(f"block {block} is not registered and cannot be cached")
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A cache hit takes an evictable block back into use."""
        del self._evictable[block]

    def evict(self) -> int:
        """Deregister and return the least recently used evictable block."""
        block, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of_block.pop(block)]
        return block

    def check_invariants(self) -> None:
        if len(self._by_hash) != len(self._hash_of_block):
            raise AssertionError("prefix cache: hash and block maps differ in size")
        for block, block_hash in self._hash_of_block.items():
            entry = self._by_hash.get(block_hash)
            if entry is None or entry.block != block:
                raise AssertionError(f"prefix cache: block {block} and its hash entry disagree")
        for block in self._evictable:
            if block not in self._hash_of_block:
                raise AssertionError(f"prefix cache: evictable block {block} is not registered")
