"""BlockManager + Scheduler under random workloads, without a model.

A simulated KV pool holds, per slot, the token whose K/V was written there. Every step
applies the scheduler's copy-on-write copies, writes the chunk's tokens at their slots (as
kv_write does) and then checks that every scheduled sequence reads back exactly its own
tokens through its block table (as paged attention does). That catches a shared block
written by two sequences, a missing copy, or a prefix-cache hit with the wrong contents.
"""

import random

import numpy as np
import pytest

from rlcu.engine.block_manager import BlockManager
from rlcu.engine.params import SamplingParams
from rlcu.engine.scheduler import Scheduler
from rlcu.engine.sequence import Sequence, Status


def _run_workload(rng, num_blocks, block_size, budget, max_seqs, n_req, prefix_caching=True, max_model_len=None,
                  lookahead=True):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    mml = max_model_len or num_blocks * block_size
    sch = Scheduler(bm, max_seqs, budget, mml)
    pool = np.full((num_blocks, block_size), -1)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 3 * block_size))] for _ in range(3)]
    reqs = []
    for r in range(n_req):
        prompt = ((rng.choice(stems) if rng.random() < 0.6 else [])
                  + [rng.randrange(50) for _ in range(rng.randrange(1, 2 * block_size))])
        prompt = prompt[: mml - 1]
        sp = SamplingParams(n=rng.choice([1, 1, 2, 3]), max_tokens=rng.randrange(1, 3 * block_size))
        seq = Sequence(r, prompt, sp, seed=r, num_samples=sp.n, stop_ids=frozenset({49}))
        reqs.append((prompt, sp))
        sch.add(seq)
    finished, steps, prev = [], 0, None
    while sch.has_unfinished() or prev:
        steps += 1
        assert steps < 10_000, "no progress"
        batch = sch.schedule()
        assert sum(batch.num_tokens) <= budget
        assert batch.seqs or prev, "nothing scheduled and nothing in flight"
        if sum(s.num_samples for s in sch.running) > max_seqs:  # only a request with n > max_seqs, alone
            assert len({s.request_id for s in sch.running}) == 1
        # the "device": copies, then K/V writes (a placeholder's value comes from the last step's samples)
        for src, dst in batch.copies:
            pool[dst] = pool[src]
        for seq, take in zip(batch.seqs, batch.num_tokens):
            c = seq.num_computed_tokens
            for p in range(c, c + take):
                tok = seq.token_ids[p]
                if tok < 0:
                    assert take == 1 and p == len(seq) - 1 and prev is not None
                    tok = prev[2][seq.pending_row]
                pool[seq.block_table[p // block_size], p % block_size] = tok
        for seq, take in zip(batch.seqs, batch.num_tokens):
            L = seq.num_computed_tokens + take
            seen = [pool[seq.block_table[p // block_size], p % block_size] for p in range(L)]
            want = [t if t >= 0 else prev[2][seq.pending_row] for t in seq.token_ids[:L]]
            assert seen == want, f"{seq} reads {seen}"
        launched = None
        if batch.seqs:
            toks = [rng.randrange(50) for _ in range(sum(batch.num_samples))]
            launched = (batch, sch.advance(batch), toks)
        if prev is not None:
            finished += sch.resolve(*prev, [0.0] * len(prev[2]))
        prev = launched
        if not lookahead and prev is not None:
            finished += sch.resolve(*prev, [0.0] * len(prev[2]))
            prev = None
        for s in finished:
            assert s.block_table == [] and s.status is Status.FINISHED and s.num_pending == 0
        bm.check(sch.live())
        assert all(not s.block_table and s.num_computed_tokens == 0 for s in sch.waiting)
    # every sample of every request finished, for the right reason
    assert sorted((s.request_id, s.sample_index) for s in finished) == sorted(
        (r, j) for r, (_, sp) in enumerate(reqs) for j in range(sp.n))
    for s in finished:
        prompt, sp = reqs[s.request_id]
        assert s.token_ids[: len(prompt)] == prompt
        out = s.completion_ids
        if s.finish_reason == "stop":
            assert out[-1] == 49 and 49 not in out[:-1]
        else:
            assert s.finish_reason == "length" and (len(out) == sp.max_tokens or len(s) == mml)
            assert 49 not in out
    assert all(b.ref == 0 for b in bm.blocks) and bm.num_free == num_blocks  # nothing leaked
    return sch, bm


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "sync"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_invariants(seed, lookahead):
    """Random pools, budgets and requests: `_run_workload` asserts the invariants after every
    step (ref counts balance, each sequence reads back its own tokens, the budget holds) and at
    the end (every sample finished for the right reason, no block leaked)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randrange(6, 14) * (8 // bs)
    sch, bm = _run_workload(rng, num_blocks, bs, budget=rng.choice([3, 7, 16, 64]), max_seqs=rng.choice([3, 8, 16]),
                            n_req=rng.randrange(8, 24), prefix_caching=seed % 3 != 0, lookahead=lookahead)
    assert not sch.has_unfinished() and not sch.live() and bm.num_free == num_blocks


def test_tiny_pool_forces_preemption_and_finishes():
    rng = random.Random(7)
    sch, _ = _run_workload(rng, num_blocks=12, block_size=4, budget=32, max_seqs=8, n_req=12)
    assert sch.num_preemptions > 0


def test_prefix_cache_hits_and_cow():
    bm = BlockManager(16, 4)
    sp = SamplingParams(n=3, max_tokens=4)
    a = Sequence(0, list(range(10)), sp, seed=0, num_samples=3)
    hits = bm.match_prefix(a)
    assert hits == []
    bm.use_prefix(a, hits)
    assert bm.reserve(a, 10) == []
    a.num_computed_tokens = 10
    bm.commit(a)
    assert a.num_hashed_blocks == 2 and len(bm.cached) == 2
    # fork: the children share all three blocks; the partial last one is copied on write
    kids = [a.fork(j) for j in (1, 2)]
    for k in kids:
        bm.fork(a, k)
    assert [bm.blocks[b].ref for b in a.block_table] == [3, 3, 3]
    for s in [a] + kids:
        s.token_ids.append(99)
    last = a.block_table[2]
    copies = [bm.reserve(s, 11) for s in [a] + kids]
    assert copies[0] and copies[1] and not copies[2]  # the last sharer writes in place
    assert copies[0][0][0] == last and kids[1].block_table[2] == last
    assert [bm.blocks[b].ref for b in a.block_table[:2]] == [3, 3]
    bm.check([a] + kids)
    # a new request with the same first 8 tokens reuses both full blocks, never the last token
    b = Sequence(1, list(range(8)) + [50, 51], sp, seed=1)
    assert bm.match_prefix(b) == a.block_table[:2]
    c = Sequence(2, list(range(8)), sp, seed=2)
    assert bm.match_prefix(c) == a.block_table[:1]  # 8 tokens: the last block must be computed
    for s in [a] + kids:
        bm.free(s)
    assert bm.num_free == 16
    assert bm.match_prefix(b) == a.block_table[:0] + [x for x in bm.match_prefix(b)]  # still cached after free
    assert len(bm.match_prefix(b)) == 2
    bm.check([])


def test_eviction_prefers_least_recently_freed():
    bm = BlockManager(4, 2)
    sp = SamplingParams(max_tokens=1)
    s = Sequence(0, [1, 2, 3, 4, 5], sp, seed=0)
    bm.use_prefix(s, [])
    bm.reserve(s, 5)
    s.num_computed_tokens = 5
    bm.commit(s)
    bm.free(s)
    # freed tail first, so the head of the prefix is evicted last
    t = Sequence(1, [9, 9, 9], sp, seed=0)
    bm.use_prefix(t, [])
    bm.reserve(t, 3)  # takes the never-used block, then the freed tail
    again = Sequence(2, [1, 2, 3, 4, 5], sp, seed=0)
    assert len(bm.match_prefix(again)) == 2


def test_books_checked_under_python_O(tmp_path):
    """The KV books' checks and the engine's contracts hold under `python -O` (they were
    asserts, which -O drops): a broken ref count, a reset with a live sequence."""
    import subprocess
    import sys

    code = (
        "from rlcu.engine.block_manager import BlockManager\n"
        "bm = BlockManager(4, 2)\n"
        "bm.blocks[1].ref = 1\n"
        "for call in (lambda: bm.check([]), bm.reset):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused:") == 2, out.stdout
    assert "block 1: ref 1, referenced 0 times" in out.stdout
