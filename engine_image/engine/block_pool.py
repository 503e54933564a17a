"""BlockPool: the engine's KV blocks, their reference counts and the prefix cache.

A block is in exactly one of two states:
- in use: ref_count > 0, held by one or more requests' block tables;
- free: ref_count == 0 and in the free queue, ready to be handed out.
A free block may still hold the KV of a full block of some earlier prompt; its
content hash then stays in the cache map, and a later prompt with the same
prefix takes it back instead of recomputing. Free blocks are reused in LRU
order, uncached ones first, so cached prefixes live as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict

# Blake2b digest of (parent digest, block tokens); see KVCacheManager.
BlockHash = bytes


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # The content hash each block is cached under, if any.
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # Content hash -> the block that holds it.
        self._cached: dict[BlockHash, int] = {}
        # Free blocks, first to be reused at the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref_count 1, or None (and nothing taken) if too few are free."""
        if n > len(self._free):
            return None
        blocks = []
        free, refs, block_hash = self._free, self._ref_counts, self._block_hash
        for _ in range(n):
            block_id, _ = free.popitem(last=False)
            digest = block_hash[block_id]
            if digest is not None:  # evict the prefix it cached
                del self._cached[digest]
                block_hash[block_id] = None
            refs[block_id] = 1
            blocks.append(block_id)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on cached blocks (a prefix-cache hit)."""
        refs, free = self._ref_counts, self._free
        for block_id in block_ids:
            if refs[block_id] == 0:
                del free[block_id]
            refs[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; a block nobody holds becomes free.

        Pass a table tail first: its last blocks are the least likely to be shared,
        so they should be reused before the prefix that precedes them.
        """
        refs, free, block_hash = self._ref_counts, self._free, self._block_hash
        for block_id in block_ids:
            count = refs[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was taken")
            refs[block_id] = count - 1
            if count == 1:
                free[block_id] = None
                if block_hash[block_id] is None:  # nothing worth keeping: reuse it first
                    free.move_to_end(block_id, last=False)

    def lookup(self, digest: BlockHash) -> int | None:
        return self._cached.get(digest)

    def cache(self, block_id: int, digest: BlockHash) -> None:
        """Record that block_id holds the full block with this content hash.

        If another block already holds the same content (two prompts prefilled in
        the same step), the first stays the cached one.
        """
        if self._block_hash[block_id] is None and digest not in self._cached:
            self._cached[digest] = block_id
            self._block_hash[block_id] = digest

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping contradicts itself."""
        for block_id, count in enumerate(self._ref_counts):
            in_free = block_id in self._free
            if count < 0:
                raise AssertionError(f"block {block_id} has ref_count {count}")
            if (count == 0) != in_free:
                raise AssertionError(f"block {block_id}: ref_count {count}, free={in_free}")
        for digest, block_id in self._cached.items():
            if self._block_hash[block_id] != digest:
                raise AssertionError(f"cache map and block {block_id} disagree on its hash")
        hashed = sum(1 for d in self._block_hash if d is not None)
        if hashed != len(self._cached):
            raise AssertionError(f"{hashed} blocks carry a hash but {len(self._cached)} are cached")
