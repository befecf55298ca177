"""PrefillGraphs (engine/prefill_graphs.py) on its own, on the CPU: the token buckets, which
steps a graph takes, the fields' layout, and that a step's fields land on the device padded
(writing nowhere, attending to nothing, no adapter) with its placeholders filled from the last
samples, and the graphs read each token's adapter slot among their fields."""

import numpy as np
import pytest
import torch

from rlcu.engine.prefill_graphs import PrefillGraphs, token_buckets
from rlcu.ops.paged_attention import prefill_tiles

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _graphs(**kw):
    return PrefillGraphs(**{**dict(budget=64, max_seqs=4, max_model_len=40, block_size=4, num_heads=4,
                                   num_kv_heads=2, device=torch.device("cpu"), weights_ptr=1), **kw})


def test_token_buckets():
    assert token_buckets(8192) == [256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert token_buckets(2048) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(16384) == [256, 512, 1024, *range(2048, 16384 + 1, 2048)]
    assert token_buckets(48) == [48] and token_buckets(256) == [256] and token_buckets(300) == [256, 300]
    for budget in (1, 100, 257, 4000, 8192, 40000):
        b = token_buckets(budget)
        assert b == sorted(set(b)) and b[-1] == budget and len(b) <= 14
        # padding adds at most an eighth of the budget (or up to 256 tokens) to a step
        assert all(hi - lo <= max(256, -(-budget // 8 // 256) * 256) for lo, hi in zip(b, b[1:]))


def _step(q_lens, ctx, ph=()):
    """prepare()'s arrays for sequences taking q_lens tokens at contexts ctx (new tokens included),
    sequence i on adapter slot i - 1 (the first on none)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    N = int(cu[-1])
    pos = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, ctx)]).astype(np.int32)
    ids = np.arange(100, 100 + N, dtype=np.int64)
    ids[list(ph)] = -1
    tables = np.arange(len(q_lens) * 10, dtype=np.int32).reshape(len(q_lens), 10)
    ts, ti = prefill_tiles(q_lens, 4, 2, ctx_lens=ctx)
    return dict(ids=ids, pos=pos, kv_slots=np.arange(N, dtype=np.int64) + 7, tables=tables, cu=cu,
                lens=np.array(ctx, dtype=np.int32), rows=cu[1:].astype(np.int64) - 1,
                ph=np.array(ph, dtype=np.int64), ph_rows=np.arange(len(ph), dtype=np.int64), tile_seq=ts,
                tile_idx=ti, max_q=max(q_lens), max_k=max(ctx),
                lora=np.repeat(np.arange(len(q_lens)) - 1, q_lens).astype(np.int32))


def test_which_steps_a_graph_takes():
    g = _graphs()
    assert g.buckets == [64]
    assert g.bucket(_step([5, 20], [5, 30]), False) == 64
    assert g.bucket(_step([1, 1], [9, 30]), False) is None  # one query token a sequence: the decode kernel
    assert g.bucket(_step([40, 30], [40, 30]), False) is None  # over the budget
    assert g.bucket(_step([2] * 5, [3] * 5), False) is None  # more sequences than the graphs hold
    assert g.bucket(_step([5, 20], [5, 30]), True) is None  # exact mode's prefill runs eagerly
    assert _graphs(budget=600).bucket(_step([200, 57], [200, 57]), False) == 512


def test_layout_is_aligned_and_load_pads_the_step():
    g = _graphs()
    assert all(off % 16 == 0 for off, _ in g.offsets.values())
    a = _step([5, 1, 20], [5, 12, 30], ph=(5,))
    last = torch.tensor([11, 22, 33])
    g.load(a, last)
    v = g._static_fields()
    N, S, T = 26, 3, len(a["tile_seq"])
    assert v["ids"][:N].tolist() == [*range(100, 105), 11, *range(106, 126)]  # the placeholder: last[0]
    assert v["ids"][N:].tolist() == [0] * (64 - N) and v["pos"][N:].tolist() == [0] * (64 - N)
    assert v["kv_slots"][:N].tolist() == list(range(7, 7 + N)) and v["kv_slots"][N:].tolist() == [-1] * (64 - N)
    assert v["cu"].tolist() == [0, 5, 6, 26, 26] and v["lens"].tolist() == [5, 12, 30, 0]
    assert v["tile_seq"][:T].tolist() == a["tile_seq"].tolist() and set(v["tile_seq"][T:].tolist()) == {-1}
    assert v["tables"][:S].tolist() == a["tables"].tolist()
    assert v["lora"][:N].tolist() == [-1] * 5 + [0] + [1] * 20 and v["lora"][N:].tolist() == [-1] * (64 - N)
    # the next step, smaller, over the other staging copy: nothing of the first is left past it
    b = _step([3], [8])
    g.load(b, None)
    assert v["ids"][:4].tolist() == [100, 101, 102, 0] and v["cu"].tolist() == [0, 3, 3, 3, 3]
    assert v["lens"].tolist() == [8, 0, 0, 0] and set(v["tile_seq"][len(b["tile_seq"]):].tolist()) == {-1}
    assert set(v["lora"][:3].tolist()) == set(v["lora"][3:].tolist()) == {-1}


def test_replay_captures_once_per_bucket_and_returns_the_steps_rows():
    g = _graphs(budget=600)
    seen = []

    def trunk(*args, lora_idx):
        ids, pos, kv_slots, tables, cu, lens, max_q, max_k, rows, tiles = args
        assert lora_idx.shape == ids.shape and lora_idx.data_ptr() == g._static_fields()["lora"].data_ptr()
        seen.append((ids.shape[0], kv_slots.max().item(), int(cu[-1]), int(tiles[0].max()), lora_idx.max().item()))
        return ids.float()[:, None] * torch.ones(1, 3)

    def record(fn):
        out = fn()
        return (lambda: out.copy_(fn())), out

    g._record = record
    h = g.replay(_step([200, 57], [200, 57]), 512, None, trunk)
    # the compile run and the capture: all padding (no writes, no sequence, no tile); the replay
    assert seen[:2] == [(512, -1, 0, -1, -1)] * 2 and seen[2][0] == 512 and seen[2][2:] == (257, 1, 0)
    assert h.shape == (257, 3) and h[:, 0].tolist() == list(range(100, 357))
    g.replay(_step([300], [310]), 512, None, trunk)
    assert set(g.graphs) == {512} and len(seen) == 4


def test_a_dropped_bucket_is_captured_on_its_second_step():
    g = _graphs()
    assert not g.take(64) and g.take(64)  # first step eagerly, the second by the graph
    g.graphs[64] = "graph"
    g.drop()
    assert not g.graphs and not g.take(64) and g.take(64)
    g.graphs[64] = "graph"
    assert g.take(64)
