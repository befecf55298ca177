"""CPU bookkeeping of the paged KV cache: which blocks each sequence owns, shared, and cached.

Blocks are reference-counted. Three kinds of sharing reach the same mechanism:
- fork: the n samples of one prompt start with the leader's whole block table (ref += 1 per
  sample), so the prompt is prefilled once;
- copy-on-write: before a sequence writes into a partially filled block that others still
  reference, it gets a fresh block and the runner copies the old one into it (the only
  block that can be both shared and written is the last, partial one of a fork);
- prefix caching: every full block of computed tokens is registered under a hash of its
  tokens chained with the hash of the block before it, so a block's key names the whole
  prefix up to its end (128-bit blake2b: collisions are negligible, and the tokens are
  compared too). A new sequence starts with the cached blocks of its longest cached prefix.
  The chain starts from the sequence's adapter slot (`Sequence.lora`): the same tokens under
  another adapter (or none) have other K/V, so their blocks never share a key.
  Freed blocks keep their contents and key and are evicted least-recently-freed first, so
  a prefix stays reusable until its blocks are actually needed. The engine drops the cache
  at the start of each generate call: the K/V of a prefix depends on the weights, which
  the trainer may have changed in place since.

A sequence's block table covers exactly its computed tokens plus the chunk being computed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from rlcu.engine.sequence import Sequence


class Block:
    __slots__ = ("id", "ref", "hash", "tokens")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref = 0
        self.hash: bytes | None = None  # prefix key, set once the block is full and computed
        self.tokens: tuple[int, ...] | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref == 0, least recently freed first
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # prefix key -> block id
        self.hit_tokens = 0  # prompt tokens served from the prefix cache (statistics)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    # ------------------------------------------------------------------ hashing
    def _block_hash(self, seq: Sequence, i: int) -> bytes:
        """Key of full block i of `seq` (cached on the sequence: it depends only on its tokens and
        its adapter, which it keeps for life)."""
        hs = seq.block_hashes
        bs = self.block_size
        while len(hs) <= i:
            j = len(hs)
            prev = hs[j - 1] if j else (b"" if seq.lora < 0 else b"lora%d:" % seq.lora)
            toks = np.asarray(seq.token_ids[j * bs:(j + 1) * bs], dtype=np.int64).tobytes()
            hs.append(hashlib.blake2b(prev + toks, digest_size=16).digest())
        return hs[i]

    # ------------------------------------------------------------------ ref counting
    def _take_free(self) -> int:
        b, _ = self.free_blocks.popitem(last=False)
        blk = self.blocks[b]
        if blk.hash is not None:  # evict its cached contents
            if self.cached.get(blk.hash) == b:
                del self.cached[blk.hash]
            blk.hash = blk.tokens = None
        blk.ref = 1
        return b

    def _ref(self, b: int) -> None:
        blk = self.blocks[b]
        if blk.ref == 0:
            del self.free_blocks[b]
        blk.ref += 1

    def _unref(self, b: int) -> None:
        blk = self.blocks[b]
        blk.ref -= 1
        if blk.ref == 0:
            self.free_blocks[b] = None

    # ------------------------------------------------------------------ admission
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of the longest cached prefix of `seq`'s tokens. The last token is
        always left to compute (its logits are needed), so at most (len-1)//block_size."""
        if not self.enable_prefix_caching:
            return []
        bs, out = self.block_size, []
        for i in range((len(seq) - 1) // bs):
            b = self.cached.get(self._block_hash(seq, i))
            if b is None or self.blocks[b].tokens != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            out.append(b)
        return out

    def admission_cost(self, hits: list[int], num_tokens: int) -> int:
        """Free blocks taken by admitting a sequence with prefix `hits` and reserving blocks
        for its first `num_tokens` tokens (a cached block with no owner leaves the free list)."""
        return max(_cdiv(num_tokens, self.block_size) - len(hits), 0) + sum(self.blocks[b].ref == 0 for b in hits)

    def use_prefix(self, seq: Sequence, hits: list[int]) -> None:
        if seq.block_table:
            raise RuntimeError(f"use_prefix needs a sequence with no blocks, {seq} has {len(seq.block_table)}")
        for b in hits:
            self._ref(b)
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        self.hit_tokens += seq.num_cached_tokens

    # ------------------------------------------------------------------ growth
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks `reserve(seq, num_tokens)` takes."""
        bs, bt, c = self.block_size, seq.block_table, seq.num_computed_tokens
        need = (num_tokens + bs - 1) // bs - len(bt)
        if need < 0:
            need = 0
        if c % bs and c < num_tokens and self.blocks[bt[c // bs]].ref > 1:
            need += 1  # copy-on-write of the shared partial block
        return need

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def reserve(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Make seq's block table cover its first `num_tokens` tokens with every block it
        will write owned by it alone. Returns the (src, dst) block copies to run first."""
        copies = []
        bs, bt, c = self.block_size, seq.block_table, seq.num_computed_tokens
        if c % bs and c < num_tokens:
            i = c // bs
            b = bt[i]
            if self.blocks[b].ref > 1:
                nb = self._take_free()
                self._unref(b)
                bt[i] = nb
                copies.append((b, nb))
        for _ in range((num_tokens + bs - 1) // bs - len(bt)):
            bt.append(self._take_free())
        return copies

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that the last step filled (full and computed) in the prefix cache."""
        n_full = seq.num_computed_tokens // self.block_size
        if n_full == seq.num_hashed_blocks:
            return
        if self.enable_prefix_caching:
            bs = self.block_size
            for i in range(seq.num_hashed_blocks, n_full):
                blk = self.blocks[seq.block_table[i]]
                if blk.hash is None:
                    blk.hash = self._block_hash(seq, i)
                    blk.tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                    self.cached.setdefault(blk.hash, blk.id)
        seq.num_hashed_blocks = n_full

    # ------------------------------------------------------------------ sharing / release
    def fork(self, parent: Sequence, child: Sequence) -> None:
        for b in parent.block_table:
            self._ref(b)
        child.block_table = list(parent.block_table)
        child.num_hashed_blocks = parent.num_hashed_blocks

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last first, so that a prefix's head is evicted last."""
        for b in reversed(seq.block_table):
            self._unref(b)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def drop_cache(self) -> None:
        """Forget every cached prefix (their K/V may be stale: the weights can change in place
        between generate calls). Blocks in use keep their contents."""
        for blk in self.blocks:
            blk.hash = blk.tokens = None
        self.cached.clear()

    def reset(self) -> None:
        """Forget every block (the device pool was released): all sequences must be gone."""
        if any(b.ref for b in self.blocks):
            raise RuntimeError("BlockManager.reset with live sequences: preempt or finish them first")
        self.__init__(self.num_blocks, self.block_size, self.enable_prefix_caching)

    # ------------------------------------------------------------------ checking
    def check(self, seqs) -> None:
        """Check the invariants against the live sequences (tests, and whoever suspects the
        books): raises RuntimeError naming the first broken one (not an assert, which -O drops)."""
        count = [0] * self.num_blocks
        for s in seqs:
            _require(len(set(s.block_table)) == len(s.block_table), f"block repeated in {s}")
            _require(len(s.block_table) == _cdiv(s.num_computed_tokens, self.block_size), f"table size of {s}")
            for b in s.block_table:
                count[b] += 1
        for blk in self.blocks:
            _require(blk.ref == count[blk.id], f"block {blk.id}: ref {blk.ref}, referenced {count[blk.id]} times")
            _require((blk.ref == 0) == (blk.id in self.free_blocks), f"block {blk.id}: ref {blk.ref} vs free list")
        for h, b in self.cached.items():
            _require(self.blocks[b].hash == h, f"cache entry of block {b} is stale")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"KV block books broken: {what}")
