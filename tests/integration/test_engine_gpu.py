"""The engine on a CUDA device: Triton kernels, bf16, CUDA graphs (skipped without a GPU)."""

import dataclasses

import pytest
import torch
from support.hf_util import make_hf_model, rel_err

from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
PROMPTS = [[5, 17, 3], list(range(40, 61)), [7] * 9, [100 + (i * 37) % 200 for i in range(70)], [1]]
FEW = 4  # bf16 vs another implementation: compare the first few greedy tokens
KV = 512  # explicit pools: an engine sized by gpu_memory_utilization counts the other engines' pools as used


def toks(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("engine_gpu"))[1]


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_greedy_within_bf16(hf32, prompt, tokens, n=FEW):
    """Each greedy token is the fp32 reference's argmax up to bf16 noise: a random model's
    logits are nearly flat, so bf16 may break near-ties differently; a wrong token from a
    broken kernel lands far below the max."""
    ids = torch.tensor([prompt + tokens[:n]], device="cuda")
    with torch.no_grad():
        logits = hf32(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n].float()
    for i, t in enumerate(tokens[:n]):
        row = logits[i]
        gap = float(row.max() - row[t])
        assert gap <= 0.02 * float(row.max() - row.min()), (i, t, int(row.argmax()), gap)


def test_greedy_bf16_matches_hf_and_twins(folder, monkeypatch):
    from transformers import Qwen3ForCausalLM

    hf32 = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    llm = LLM(folder, device="cuda", dtype="bfloat16", num_kv_blocks=KV, max_num_batched_tokens=32)
    assert llm.model.dtype == torch.bfloat16
    outs = llm.generate(toks(PROMPTS), dataclasses.replace(GREEDY, n=2), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == o.outputs[1].token_ids  # greedy forks agree
        _assert_greedy_within_bf16(hf32, p, o.outputs[0].token_ids)
    # the same engine on the reference twins (RLCU_BACKEND=torch), same device and dtype
    monkeypatch.setenv("RLCU_BACKEND", "torch")
    twin = LLM(llm.model, num_kv_blocks=KV, enforce_eager=True).generate(
        toks(PROMPTS), GREEDY, use_tqdm=False)
    for p, b in zip(PROMPTS, twin):
        _assert_greedy_within_bf16(hf32, p, b.outputs[0].token_ids)


def test_fp32_cuda_matches_hf_exactly(folder):
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    llm = LLM(folder, device="cuda", dtype="float32", num_kv_blocks=KV, block_size=16)
    outs = llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids[:12] == ref[:12]


def test_cuda_graphs_equal_eager(folder):
    m = Qwen3.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    sp = dataclasses.replace(GREEDY, n=3)
    eager = LLM(m, enforce_eager=True, num_kv_blocks=KV).generate(toks(PROMPTS), sp, use_tqdm=False)
    llm = LLM(m, num_kv_blocks=KV, max_num_seqs=8)
    graphed = llm.generate(toks(PROMPTS), sp, use_tqdm=False)
    assert llm.stats["graph_steps"] > 0 and llm.runner.graphs
    assert _tokens(graphed) == _tokens(eager)
    for a, b in zip(eager, graphed):
        for x, y in zip(a.outputs, b.outputs):
            assert rel_err(torch.tensor(y.logprobs), torch.tensor(x.logprobs)) < 2e-2
    # seeded sampling: graphs and eager draw the same tokens
    sp = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=16, seed=1, ignore_eos=True)
    a = LLM(m, enforce_eager=True, num_kv_blocks=KV).generate(toks(PROMPTS[:3]), sp, use_tqdm=False)
    b = llm.generate(toks(PROMPTS[:3]), sp, use_tqdm=False)
    assert _tokens(a) == _tokens(b)


def test_prefill_graphs_equal_eager_prefill(folder):
    """Prefill and mixed steps by their CUDA graphs (chunked prompts, decodes riding along,
    padded token buckets, n > 1 rows) against the same engine's eager prefill: the same greedy
    and seeded tokens, logprobs within bf16 noise, and the graphs did run."""
    m = Qwen3.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    kw = dict(num_kv_blocks=KV, max_num_seqs=8, max_num_batched_tokens=48, warmup=False)
    eager = LLM(m, prefill_graphs=False, **kw)
    llm = LLM(m, **kw)
    for sp in (dataclasses.replace(GREEDY, n=2),
               SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=16, seed=1, ignore_eos=True, logprobs=True)):
        a = eager.generate(toks(PROMPTS), sp, use_tqdm=False)
        b = llm.generate(toks(PROMPTS), sp, use_tqdm=False)
        assert _tokens(a) == _tokens(b)
        for x, y in zip(a, b):
            for u, v in zip(x.outputs, y.outputs):
                assert rel_err(torch.tensor(v.logprobs), torch.tensor(u.logprobs)) < 2e-2
    assert set(llm.runner.prefill_graphs.graphs) == {48} and not eager.runner.prefill_graphs.graphs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graphs_on_two_devices_of_one_process(folder):
    """One process, engines on cuda:0 and then cuda:1 (a warm worker serving jobs on either
    GPU): the second engine's graphs are captured on its own device, not on the stream of
    the first capture, and equal its eager steps."""
    m0 = Qwen3.from_pretrained(folder, device="cuda:0", dtype=torch.bfloat16)
    first = _tokens(LLM(m0, num_kv_blocks=KV).generate(toks(PROMPTS), GREEDY, use_tqdm=False))
    with torch.cuda.device(1):
        m1 = Qwen3.from_pretrained(folder, device="cuda:1", dtype=torch.bfloat16)
        llm = LLM(m1, num_kv_blocks=KV)
        graphed = _tokens(llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False))
        assert llm.stats["graph_steps"] > 0 and llm.runner.graphs
        eager = _tokens(LLM(m1, enforce_eager=True, num_kv_blocks=KV).generate(toks(PROMPTS), GREEDY,
                                                                              use_tqdm=False))
    assert graphed == eager == first


def test_weight_update_seen_by_graphs(folder):
    m = Qwen3.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    llm = LLM(m, num_kv_blocks=KV)
    before = _tokens(llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False))
    m.flat.add_(0.05 * torch.randn_like(m.flat))  # an optimizer step, in place
    after = _tokens(llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False))
    eager = _tokens(LLM(m, enforce_eager=True, num_kv_blocks=KV).generate(toks(PROMPTS), GREEDY, use_tqdm=False))
    assert after != before and after == eager


def test_sleep_releases_memory(folder):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    m = Qwen3.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    llm = LLM(m, gpu_memory_utilization=0.3)  # sized from the device's memory
    a = _tokens(llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False))
    held = torch.cuda.memory_reserved()
    llm.sleep()
    assert torch.cuda.memory_reserved() < held - llm.runner.num_blocks * llm.runner.block_bytes // 2
    llm.wake()
    assert _tokens(llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False)) == a


def test_sleep_keeping_graphs(folder):
    """sleep(keep_graphs=True) frees the pool; after wake the kept (or recaptured) graphs give
    the same seeded samples as an eager engine, with an optimizer-like update in between."""
    m = Qwen3.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=3, ignore_eos=True)
    llm = LLM(m, num_kv_blocks=KV, max_num_seqs=8)
    llm.generate(toks(PROMPTS), sp, use_tqdm=False)
    for _ in range(3):
        # what this sleep holds: the engine start captured every planned graph; a wake whose pool
        # moves drops them and the generate after it captures only the batch sizes it meets
        n_graphs = len(llm.runner.graphs)
        held = torch.cuda.memory_reserved()
        llm.sleep(keep_graphs=True)
        assert llm.runner.kv is None and len(llm.runner.graphs) == n_graphs
        assert torch.cuda.memory_reserved() <= held - KV * llm.runner.block_bytes // 2
        m.flat.add_(0.01 * torch.randn_like(m.flat))  # training in between, in place
        llm.wake()
        got = _tokens(llm.generate(toks(PROMPTS), sp, use_tqdm=False))
        want = _tokens(LLM(m, enforce_eager=True, num_kv_blocks=KV).generate(toks(PROMPTS), sp, use_tqdm=False))
        assert got == want and llm.stats["graph_steps"] > 0
    print("graph wakes:", llm.runner.graph_wakes)
    assert sum(llm.runner.graph_wakes.values()) == 3


def test_preemption_and_chunking_on_gpu(folder):
    m = Qwen3.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    ref = _tokens(LLM(m, num_kv_blocks=KV).generate(toks(PROMPTS), GREEDY, use_tqdm=False))
    llm = LLM(m, num_kv_blocks=8, block_size=16, max_num_batched_tokens=16)
    got = _tokens(llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False))
    assert llm.stats["preemptions"] > 0
    assert [g[0][:FEW] for g in got] == [r[0][:FEW] for r in ref]
