"""The engine's start warm-up on CUDA (engine/warmup.py): after `LLM(...)` a generate of every
step kind (prefill, chunked prefill mixed with decodes, decode batches of many sizes and
contexts in two buckets, forks, filtered and greedy sampling) compiles no Triton kernel and
captures no CUDA graph, and the process stays within gpu_memory_utilization."""

import pytest
import torch

from bench.common import qwen3_06b_config
from bench.generate import random_model
from rlcu.engine import LLM, SamplingParams
from rlcu.ops._backend import compiled_variants
from rlcu.ops.paged_attention import decode_splits, paged_attention, sm_count

pytestmark = pytest.mark.gpu


def _workload(V: int):
    """Prompts of 20 .. 1500 tokens (a prefill budget of 512: chunked prefill, mixed steps),
    outputs of 3 .. 700 tokens (decode batches shrink through every bucket, contexts cross
    1024), greedy, temperature-only and filtered rows, n = 1 and 3."""
    g = torch.Generator().manual_seed(0)
    prompts, params = [], []
    for i in range(40):
        n = int(torch.randint(20, 1500 if i % 8 == 0 else 300, (1,), generator=g))
        prompts.append({"prompt_token_ids": torch.randint(0, V, (n,), generator=g).tolist()})
        kind = i % 3
        params.append(SamplingParams(n=3 if i % 10 == 0 else 1, temperature=(0.0, 0.7, 1.0)[kind],
                                     top_p=0.9 if kind == 2 else 1.0, top_k=50 if kind == 2 else -1,
                                     max_tokens=3 + (i * 37) % 700, ignore_eos=True, seed=i))
    return prompts, params


def test_unsplit_decode_is_the_same_at_any_context_bucket(monkeypatch):
    """The merge of DecodeGraphs.key: a batch that runs unsplit launches the same kernel for a
    context bucket of 1k, 4k or max_model_len (its one split covers any context), bit for bit."""
    from rlcu.ops import paged_attention as pa

    monkeypatch.setitem(pa.CONFIGS, "decode_plan", dict(pa.CONFIGS["decode_plan"], kernel="split"))  # merged buckets
    S, Hq, Hk, D, BS = 256, 16, 8, 128, 16
    sms = sm_count(torch.device("cuda"))
    assert all(decode_splits(S, Hk, k, sms)[0] == 1 for k in (1024, 4096, 40960))
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(600, BS, Hk, D, device="cuda", generator=g).bfloat16()
    vc = torch.randn(600, BS, Hk, D, device="cuda", generator=g).bfloat16()
    q = torch.randn(S, Hq, D, device="cuda", generator=g).bfloat16()
    lens = torch.randint(1, 1000, (S,), device="cuda", generator=g, dtype=torch.int32)
    tables = torch.randint(0, 600, (S, 40960 // BS), device="cuda", generator=g, dtype=torch.int32)
    cu = torch.arange(S + 1, device="cuda", dtype=torch.int32)
    outs = [paged_attention(q, kc, vc, tables, cu, lens, 1, kb, D**-0.5) for kb in (1024, 4096, 40960)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_first_generate_compiles_and_captures_nothing(eager):
    import gc

    gc.collect()
    cfg = qwen3_06b_config(num_hidden_layers=2)
    m = random_model(cfg, "cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    util = 0.5
    llm = LLM(m, max_num_seqs=64, max_num_batched_tokens=512, gpu_memory_utilization=util, enforce_eager=eager)
    st = llm.startup
    print("startup:", st, "probe:", llm.runner.memory_probe)
    r = llm.runner
    assert st["warmup"] is not None
    if not eager:
        assert st["warmup"]["graphs"] == len(r.graphs) == len(r.graph_plan()) > 0
    before_compiles, before_captures = compiled_variants(), r.num_captures
    assert sum(before_compiles.values()) > 0
    prompts, params = _workload(cfg.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == sum(p.n * p.max_tokens for p in params)
    ctx = max(c for _n, _s, c, _g, _dt in llm.stats["step_log"])
    assert ctx > 0
    new = {k: v - before_compiles.get(k, 0) for k, v in compiled_variants().items() if v != before_compiles.get(k, 0)}
    assert not new, f"kernels compiled inside the first generate: {new}"
    assert r.num_captures == before_captures, "graphs captured inside the first generate"
    if not eager:
        assert llm.stats["graph_steps"] > 0
    free, total = torch.cuda.mem_get_info()
    used = total - free
    print(f"used {used / 2**30:.2f} GiB of {util} x {total / 2**30:.1f} GiB; graph memory "
          f"{st['warmup']['graph_memory_bytes'] / 2**20:.1f} MiB (probe "
          f"{r.memory_probe.get('graph_bytes', 0) / 2**20:.1f} MiB)")
    assert used <= util * total + (64 << 20)
