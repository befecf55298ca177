"""The engine's start warm-up on the CPU: which decode graphs it plans (every key a step can
ask for, the unsplit batches merged into one context bucket), and that warming up leaves the
engine's outputs byte-identical."""

import dataclasses
import itertools

import pytest
import torch

from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams
from rlcu.engine.graphs import context_bucket, context_buckets, graph_buckets
from rlcu.model.config import Qwen3Config
from rlcu.ops.paged_attention import decode_splits

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_buckets():
    assert graph_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20] and graph_buckets(1) == [1]
    assert [context_bucket(k, 40960) for k in (1, 1024, 1025, 4096, 4097, 40000)] == [1024, 1024, 4096, 4096,
                                                                                      16384, 40960]
    assert context_bucket(300, 512) == 512
    assert context_buckets(40960, 40960) == [1024, 4096, 16384, 40960]
    assert context_buckets(2064, 40960) == [1024, 4096] and context_buckets(100, 512) == [512]


def _model(Hk=8, max_pos=40960):
    """Qwen3-0.6B's head layout (16 q / 8 kv heads), tiny widths, one layer."""
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2 * Hk, num_key_value_heads=Hk, head_dim=16,
                      max_position_embeddings=max_pos, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=None)
    from rlcu.model.layout import ParamLayout

    return Qwen3(cfg, torch.zeros(ParamLayout(cfg).numel))


def test_graph_plan_covers_every_step_and_merges_unsplit_batches(monkeypatch):
    from rlcu.ops import paged_attention as pa

    monkeypatch.setitem(pa.CONFIGS, "decode_plan", dict(pa.CONFIGS["decode_plan"], kernel="split"))
    llm = LLM(_model(), num_kv_blocks=40960 // 16, warmup=False)
    r = llm.runner
    assert r.max_model_len == 40960
    plan = r.graph_plan()
    assert len(plan) == len(set(plan))
    assert [b for b, _ in plan] == sorted((b for b, _ in plan), reverse=True)  # largest batch first
    # every decode step a run can make asks for a planned graph
    keys = {r.decode_graphs.key(S, k) for S, k in itertools.product(range(1, 257), [1, 2, 1000, 1024, 1025, 3000, 4096,
                                                                              5000, 16384, 20000, 40960])}
    assert keys == set(plan)
    # batches that run unsplit at every bucket (S x Hk fills unsplit_per_sm programs an SM: 64
    # rows and up at 8 KV heads; with a split cap, long_per_sm) have one graph, at
    # max_model_len; the split ones one per context bucket
    sc = pa.CONFIGS["splits"]
    lo = -(-sc["long_per_sm" if sc["max_part"] else "unsplit_per_sm"] * 132 // 8)
    wide = [b for b in graph_buckets(256) if b >= lo]
    narrow = [b for b in graph_buckets(256) if b < lo]
    assert wide and narrow
    assert {(b, 40960) for b in wide} <= set(plan)
    assert {(b, kb) for b in narrow for kb in (1024, 4096, 16384, 40960)} <= set(plan)
    assert len(plan) == len(wide) + 4 * len(narrow)
    for b, kb in plan:  # a merged graph launches what its own bucket's graph would: one split
        if kb == 40960 and b >= lo:
            assert all(decode_splits(b, 8, k)[0] == 1 for k in (1024, 4096, 16384, 40960))
    # capture_graphs(max_context) plans the same keys, up to that context
    assert set(r.graph_plan(2064)) == {r.decode_graphs.key(S, k) for S in range(1, 257) for k in (1, 2064)}


def test_graph_plan_one_graph_a_batch_for_the_list_kernel(monkeypatch):
    """The list kernel's launch follows the batch only: one graph a batch bucket, at
    max_model_len, serves every context."""
    from rlcu.ops import paged_attention as pa

    monkeypatch.setitem(pa.CONFIGS, "decode_plan", dict(pa.CONFIGS["decode_plan"], kernel="list"))
    r = LLM(_model(), num_kv_blocks=40960 // 16, warmup=False).runner
    plan = r.graph_plan()
    keys = {r.decode_graphs.key(S, k) for S, k in itertools.product(range(1, 257), [1, 1024, 1025, 5000, 20000, 40960])}
    assert keys == set(plan) == {(b, 40960) for b in graph_buckets(256)}


def test_graph_plan_small_model_len():
    llm = LLM(_model(), num_kv_blocks=32, warmup=False, max_num_seqs=20)  # 512 tokens
    assert llm.max_model_len == 512
    assert llm.runner.graph_plan() == [(b, 512) for b in (20, 16, 8, 4, 2, 1)]


def test_warmup_keeps_outputs_byte_identical():
    m = _model(Hk=2, max_pos=512)
    torch.manual_seed(0)
    m.flat.normal_(0, 0.3)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9] * 7, [1, 2, 3], list(range(20)))]
    sp = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, seed=3, logprobs=True)
    outs = []
    for warm in (False, True):
        llm = LLM(m, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, warmup=warm)
        assert (llm.startup["warmup"] is None) == (not warm)
        got = [llm.generate(prompts, sp, use_tqdm=False), llm.generate(prompts, dataclasses.replace(sp, seed=4),
                                                                       use_tqdm=False)]
        outs.append([[(c.token_ids, c.logprobs) for o in g for c in o.outputs] for g in got])
    assert outs[0] == outs[1]
    st = llm.startup
    assert st["warmup"]["graphs"] == 0 and st["warmup"]["eager_decode_steps"] == 1 and st["seconds"] >= 0


def test_warmup_default_and_checks():
    m = _model(Hk=2, max_pos=512)
    assert LLM(m, num_kv_blocks=8).startup["warmup"] is None  # off on the CPU
    with pytest.raises(ValueError, match="LLM.warmup"):
        LLM(m, num_kv_blocks=8, warmup="yes")
    llm = LLM(m, num_kv_blocks=8)
    llm.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.runner.warm_up()


def test_warmup_captures_every_graph_the_run_replays_emulated():
    """The graph path on the CPU (a 'graph' re-runs the captured step at replay, as in
    test_engine.py): after the warm-up, generate replays graphs and captures none, with the
    outputs of an engine without graphs."""
    m = _model(Hk=2, max_pos=512)
    torch.manual_seed(1)
    m.flat.normal_(0, 0.3)
    prompts = [{"prompt_token_ids": list(range(i, i + 3 + 5 * i))} for i in range(7)]
    sp = [SamplingParams(temperature=0.8, top_k=5, max_tokens=2 + 3 * i, seed=i, logprobs=True) for i in range(7)]
    ref = LLM(m, num_kv_blocks=64, block_size=4, max_num_seqs=6).generate(prompts, sp, use_tqdm=False)
    llm = LLM(m, num_kv_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=512, warmup=False)
    r = llm.runner
    r.use_graphs = True

    def recorder(graphs):
        def record(fn):
            out = fn()
            graphs.num_captures += 1
            return (lambda: [o.copy_(n) for o, n in zip(out, fn())]), out
        return record

    r.decode_graphs._record = recorder(r.decode_graphs)
    r.prefill_graphs._record = recorder(r.prefill_graphs)
    st = r.warm_up()
    assert r.max_model_len == 256 and r.graph_plan() == [(6, 256), (4, 256), (2, 256), (1, 256)]
    assert st["captures"] == 4 and set(r.graphs) == set(r.graph_plan())
    assert st["prefill_graphs"] == 2 and set(r.prefill_graphs.graphs) == {256, 512}
    n, n_prefill = r.num_captures, r.prefill_graphs.num_captures
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert r.num_captures == n and r.prefill_graphs.num_captures == n_prefill and llm.stats["graph_steps"] > 0
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-5)
