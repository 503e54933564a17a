"""KVCacheManager: each request's block table, on top of the BlockPool.

The narrow interface the scheduler uses:
    match_prefix(request)            -> cached blocks the prompt can reuse
    allocate(request_id, n, cached)  -> new blocks so the table holds n tokens, or None
    cache_computed(request)          -> offer newly full blocks to the prefix cache
    trim(request_id, n)              -> give back blocks past the first n tokens
    free(request_id)
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Mapping

from tandem.engine.block_pool import BlockHash, BlockPool
from tandem.engine.request import Request

_ROOT_HASH: BlockHash = b"tandem-kv-root"


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """Content hash of a full block, chained to the blocks before it.

    A cryptographic hash, not Python's hash(): ints hash predictably, so one
    tenant could craft a prompt whose blocks collide with another's and read
    its KV. blake2b of 128 bits costs about a microsecond per block.
    """
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent of a prompt's first block: a salt starts a chain of its own."""
    if cache_salt is None:
        return _ROOT_HASH
    return hashlib.blake2b(_ROOT_HASH + b"\0" + cache_salt.encode(), digest_size=16).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        # Content hashes of each request's full blocks, computed once.
        self._hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each table were offered to the prefix cache.
        self._offered: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks (empty if it holds none). The list is live: do not keep it."""
        return self._tables.get(request_id) or []

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_taken(self, num_tokens: int, cached: list[int]) -> int:
        """Free blocks a new request of num_tokens would take into use: its new
        blocks, and the cached blocks of its prefix that nobody holds now (those
        count as free until then)."""
        revived = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        return self.blocks_for(num_tokens) - len(cached) + revived

    def usage_with(self, more_blocks: int) -> float:
        """KV usage once more_blocks more are in use: one division, as `usage` is
        computed, so a pool that would land exactly on a watermark compares equal."""
        used = self.pool.num_blocks - self.pool.num_free
        return (used + more_blocks) / self.pool.num_blocks

    def match_prefix(
        self, request: Request, computing: Mapping[BlockHash, int] | None = None
    ) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens, and after
        them blocks `computing` holds (an earlier sequence of the same prefill step
        completes them: a layer's KV is written for every sequence before any attends).

        At least one token is left to compute: the last prompt position must run
        through the model to give the logits of the first output token. Nothing
        is taken yet: pass the result to allocate().
        """
        if not self.enable_prefix_caching:
            return []
        computing = computing or {}
        blocks: list[int] = []
        for digest in self._hashes_of(request, (len(request.token_ids) - 1) // self.block_size):
            block_id = self.pool.lookup(digest)
            if block_id is None:
                block_id = computing.get(digest)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def completed_by(self, request: Request, start: int, end: int) -> dict[BlockHash, int]:
        """The blocks a step computing the request's tokens start to end fills, by their
        content hash: match_prefix's `computing` for the prompts after it in the step
        (n choices of one prompt, a burst sharing a system prompt computed it n times)."""
        if not self.enable_prefix_caching:
            return {}
        size, table = self.block_size, self._tables[request.request_id]
        first = start // size
        hashes = enumerate(self._hashes_of(request, end // size))
        return {digest: table[i] for i, digest in hashes if i >= first}

    def _hashes_of(self, request: Request, num_blocks: int) -> Iterator[BlockHash]:
        """The content hashes of the request's first num_blocks full blocks, each
        computed once (a lookup stops at its first miss: later ones are never hashed)."""
        size, tokens = self.block_size, request.token_ids
        hashes = self._hashes.setdefault(request.request_id, [])
        for i in range(num_blocks):
            if i == len(hashes):
                parent = hashes[i - 1] if i else root_hash(request.cache_salt)
                hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size]))
            yield hashes[i]

    def allocate(
        self, request_id: str, num_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold num_tokens tokens.

        cached_blocks (from match_prefix, only for a request that holds no
        blocks yet) start the table. Returns the newly allocated blocks, or None
        when the pool is too short, in which case nothing changed.
        """
        table = self._tables.get(request_id)
        cached = cached_blocks or []
        if cached and table:
            raise ValueError(f"request {request_id!r} already holds blocks; no prefix to reuse")
        have = len(table) if table else 0
        needed = self.blocks_for(num_tokens) - have - len(cached)
        if needed <= 0 and not cached:
            return []
        # Cached blocks nobody holds now come out of the free queue too.
        pool = self.pool
        revived = sum(1 for b in cached if pool.ref_count(b) == 0)
        if max(needed, 0) + revived > pool.num_free:
            return None
        if cached:
            pool.share(cached)
        new = pool.allocate(max(needed, 0)) or []
        if table is None:
            table = self._tables[request_id] = []
        table.extend(cached)
        table.extend(new)
        return new

    def cache_computed(self, request: Request) -> None:
        """Offer the request's full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        # Blocks whose KV is computed and whose tokens are all known (a stop can cut
        # the tokens of a step short of the KV it computed).
        computed = min(request.num_computed_tokens, len(request.token_ids))
        num_full = computed // self.block_size
        offered = self._offered.get(rid, 0)
        if num_full <= offered:
            return
        table = self._tables[rid]
        hashes = list(self._hashes_of(request, num_full))
        for i in range(offered, num_full):
            self.pool.cache(table[i], hashes[i])
        self._offered[rid] = num_full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past those holding num_tokens tokens: blocks a
        step took for drafts it rejected. They hold no computed KV, so none was offered
        to the prefix cache."""
        table = self._tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        if table is None or len(table) <= keep:
            return
        if keep < self._offered.get(request_id, 0):
            raise ValueError(f"request {request_id!r}: trimming would drop a cached block")
        tail = table[keep:]
        del table[keep:]  # in place: the request's block_ids is this same list
        self.pool.free(tail[::-1])

    def free(self, request_id: str) -> None:
        """Give back every block the request holds (the prefix cache may keep them)."""
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._offered.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])

    def check_integrity(self) -> None:
        """Raise AssertionError if tables and pool reference counts disagree."""
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        for table in self._tables.values():
            for block_id in table:
                counts[block_id] = counts.get(block_id, 0) + 1
        for block_id in range(self.pool.num_blocks):
            if counts.get(block_id, 0) != self.pool.ref_count(block_id):
                raise AssertionError(
                    f"block {block_id}: {counts.get(block_id, 0)} tables hold it, "
                    f"ref_count {self.pool.ref_count(block_id)}"
                )
