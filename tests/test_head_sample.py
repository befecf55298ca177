"""ops/head_sample.py: the LM head with the sampler's first pass in its epilogue. The kernel (on
the CPU through TRITON_INTERPRET=1, at small odd shapes: several vocabulary tiles, a cut last
tile, batches that are not a tile's multiple) returns the logits of h W^T and exactly the tokens
`sampling.sample` draws from those logits (temperature, greedy rows, top-k, top-p, min-p, ties),
with its logprobs; the twin is the plain composition."""

import warnings

import pytest
import torch

import rlcu.ops.head_sample as hs
import rlcu.ops.sampling as smp

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [(0.7, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.8, 0, 1.0, 0.05),
        (1.3, 7, 0.8, 0.01), (1.0, 0, 1.0, 0.0)]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    warnings.filterwarnings("ignore", "divide by zero", RuntimeWarning)  # log(0) in the interpreter


def _inputs(B, V, K, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, K, generator=g).to(dtype)
    W = (torch.randn(V, K, generator=g) * 3 / K**0.5).to(dtype)
    W[V // 2] = W[V // 3]  # two equal logits in every row: a tie for argmax and the filters
    rows = [ROWS[i % len(ROWS)] for i in range(B)]
    params = (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows], dtype=torch.int32),
              torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]),
              torch.arange(B, dtype=torch.int64) * 13 + 1, torch.arange(B, dtype=torch.int64) + 3)
    return h.to(DEV), W.to(DEV), tuple(t.to(DEV) for t in params)


@pytest.mark.parametrize("B, V, K", [(7, 200, 48), (20, 97, 32), (1, 64, 16)])
def test_kernel_draws_what_the_sampler_draws_from_its_logits(triton_backend, B, V, K):
    h, W, params = _inputs(B, V, K)
    toks, lps, logits = hs.head_sample(h, W, *params)
    assert logits.shape == (B, V) and logits.dtype == h.dtype
    torch.testing.assert_close(logits.cpu(), (h @ W.t()).cpu(), rtol=1e-5, atol=1e-5)
    ref_toks, ref_lps = smp.sample(logits, *params)  # the sampler's own two kernels on those logits
    assert torch.equal(toks, ref_toks)
    torch.testing.assert_close(lps, ref_lps, rtol=1e-5, atol=1e-5)
    twin_toks, twin_lps = smp.sample_ref(logits.cpu(), *(t.cpu() for t in params))
    assert torch.equal(toks.cpu(), twin_toks)
    torch.testing.assert_close(lps.cpu(), twin_lps, rtol=1e-5, atol=1e-5)


def test_twin_is_the_composition():
    h, W, params = _inputs(5, 70, 24)
    h, W, params = h.cpu(), W.cpu(), tuple(t.cpu() for t in params)
    toks, lps, logits = hs.head_sample(h, W, *params)
    assert torch.equal(logits, h @ W.t())
    ref = smp.sample_ref(h @ W.t(), *params)
    assert torch.equal(toks, ref[0]) and torch.equal(lps, ref[1])


def test_bad_shapes_name_the_argument():
    h, W, params = _inputs(3, 40, 8)
    with pytest.raises(ValueError, match=r"h \[B, K\] and W \[V, K\]"):
        hs.head_sample(h, W[:, :4], *params)
    with pytest.raises(ValueError, match=r"seeds must be \[3\]"):
        hs.head_sample(h, W, *params[:4], params[4][:2], params[5])


def test_engine_switch_samples_through_it(monkeypatch):
    """paged_forward.sample_rows with the op on: the twin on the CPU, so exactly the engine's tokens
    and logprobs without it."""
    from rlcu.engine import LLM, SamplingParams
    from rlcu.model.config import Qwen3Config
    from rlcu.model.qwen3 import Qwen3

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    m = Qwen3.from_config(cfg, "cpu", torch.float32, 0)
    calls = []
    real = hs.head_sample
    monkeypatch.setattr("rlcu.engine.paged_forward.head_sample", lambda *a: calls.append(1) or real(*a))
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(4)]
    sp = SamplingParams(n=2, temperature=0.9, top_k=20, max_tokens=6, ignore_eos=True, seed=5, logprobs=True)
    outs = []
    for on in (False, True):
        monkeypatch.setitem(hs.CONFIGS, "enabled", on)
        llm = LLM(m, max_num_seqs=8, num_kv_blocks=64)
        outs.append([(o.token_ids, o.logprobs) for r in llm.generate(prompts, sp, use_tqdm=False) for o in r.outputs])
        assert bool(calls) == on
    assert outs[0] == outs[1]
