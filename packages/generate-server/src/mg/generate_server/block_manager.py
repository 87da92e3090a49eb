"""Which KV-cache blocks are free, who holds each, and which hold a known prompt prefix.

The pool (`mg.core.models.paged_kv_cache.PagedKVCache`) has `num_blocks`
blocks of `block_size` positions. A sequence holds the blocks of its block
table; a block may be held by several sequences at once (a shared prompt
prefix), so each has a reference count.

Prefix caching: a block that is full is named by the hash of its tokens and
of everything before it (the previous block's hash), so equal names mean equal
keys and values. When the last holder lets go of a named block it is not
wiped: it stays in an LRU list and a later prompt that starts with the same
tokens takes it back instead of recomputing it. Allocation takes never-named
free blocks first, then evicts the least recently released named one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The name of a full block: its tokens and the name of the block before it."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV-cache pool needs at least one block of at least one position")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # a stack popped from the end: low block ids first, recently freed ones reused first
        # (on the CPU the pool's pages are touched only when written, so this keeps it compact)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Named blocks nobody holds, least recently released first."""

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now (free, or named but unheld)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        """Named blocks kept for later prompts that nobody holds now."""
        return len(self._evictable)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks held once each, or None (nothing taken) if the pool lacks them."""
        if count > self.num_available:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """The named blocks that hold the longest cached prefix of `tokens` (held once more
        each; release them when done) and their names. The last token is never matched:
        its logits are needed, so at least one token is always computed."""
        if not self.prefix_caching:
            return [], []
        blocks: list[int] = []
        hashes: list[int] = []
        parent = None
        for i in range((len(tokens) - 1) // self.block_size):
            name = block_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self._block_of.get(name)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            blocks.append(block)
            hashes.append(name)
            parent = name
        return blocks, hashes

    def name(self, block: int, name: int) -> None:
        """`block` is full and holds the tokens `name` describes: later prompts may reuse it.
        (If another block already holds them, that one stays the one found.)"""
        if self.prefix_caching and name not in self._block_of and block not in self._hash_of:
            self._block_of[name] = block
            self._hash_of[block] = name
