"""DecodeGraphs (engine/graphs.py) on its own, on the CPU: when graphs are dropped (the weights
moved, exact mode switched, a new KV pool elsewhere), and that a capture writes nowhere and
leaves the step's fields as they were while a replay runs on them. A "graph" re-runs the
captured step at replay, as in test_engine.py."""

import math

import pytest
import torch

from rlcu.engine.graphs import DecodeGraphs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _graphs(**kw):
    return DecodeGraphs(**{**dict(max_num_seqs=6, max_model_len=256, block_size=4, num_kv_heads=2,
                                  device=torch.device("cpu"), weights_ptr=100), **kw})


def test_follow_drops_on_moved_weights_or_switched_mode():
    g = _graphs()
    assert not g.exact
    g.graphs[(1, 256)] = "graph"
    g.follow(100, False)
    assert g.graphs
    g.follow(200, False)
    assert not g.graphs and g.weights_ptr == 200
    g.graphs[(1, 256)] = "graph"
    g.follow(200, True)  # the model's exact mode switched
    assert not g.graphs and g.exact
    g.graphs[(1, 256)] = "graph"
    g.follow(200, True)
    assert g.graphs
    g.follow(200, False)
    assert not g.graphs and not g.exact


def test_rebind_keeps_graphs_only_at_the_old_pool_address():
    g = _graphs()
    g.rebind(5)  # no graphs: nothing to keep, no wake counted
    assert g.wakes == {"kept": 0, "recaptured": 0}
    g.graphs[(1, 256)] = "graph"
    g.keep(7)
    g.rebind(7)
    assert g.graphs and g.wakes == {"kept": 1, "recaptured": 0}
    g.keep(7)
    g.rebind(8)
    assert not g.graphs and g._static is None and g.wakes == {"kept": 1, "recaptured": 1}


class _Dec:
    """The parts of DecodeState a graph reads: its device fields, sampling rows, block tables."""

    def __init__(self, n, W):
        self.dev = dict(ids=torch.arange(10, 10 + n), pos=torch.arange(n, dtype=torch.int32),
                        kv_slots=torch.arange(50, 50 + n), lens=torch.arange(1, n + 1, dtype=torch.int32) * 3)
        self.tables = torch.arange(n * W, dtype=torch.int32).view(n, W)

    def sampling(self, b):
        return ("samp", b)

    def block_tables(self, b, W):
        return self.tables[:b, :W]


def test_capture_writes_nowhere_and_replay_reads_the_step_fields():
    g = _graphs()
    dec = _Dec(6, math.ceil(256 / 4))
    want = {k: v.clone() for k, v in dec.dev.items()}
    seen, captures = [], []

    def step(args, samp):
        ids, pos, kv_slots, tables, cu, lens, max_q, kb = args
        seen.append((kv_slots.tolist(), lens.tolist(), tables[:, :2].tolist(), kb, samp))
        return ids * 2, lens.float()

    def record(fn):
        captures.append(1)
        out = fn()
        return (lambda: [o.copy_(n) for o, n in zip(out, fn())]), out

    g._record = record
    tokens, logprobs = g.replay(3, 10, dec, step)
    assert captures == [1] and set(g.graphs) == {(4, 256)}
    # the warm-up and the capture runs: 4 rows writing nowhere, at context 1
    assert [s[:2] for s in seen[:2]] == [([-1] * 4, [1] * 4)] * 2 and seen[0][3:] == (256, ("samp", 4))
    assert all(torch.equal(dec.dev[k], want[k]) for k in want)  # the fields are back
    # the replay: the step's own fields and block tables, 3 rows of the 4 returned
    assert seen[2][:3] == (want["kv_slots"][:4].tolist(), want["lens"][:4].tolist(), dec.tables[:4, :2].tolist())
    assert tokens.tolist() == (want["ids"][:3] * 2).tolist() and logprobs.tolist() == want["lens"][:3].float().tolist()
    g.replay(4, 200, dec, step)  # the same key: no capture
    assert captures == [1] and len(seen) == 4
