"""Exact mode's checks that run on the twins (tests/integration/test_exact.py) and again through
the Triton kernels under the interpreter (test_exact_triton.py): a random fp32 model, the GEMM's
rows and attention's packed, paged and chunked outputs, bit for bit."""

import torch

from rlcu import Qwen3
from rlcu.model.config import Qwen3Config
from rlcu.ops.attention import attention_fwd_ref
from rlcu.ops.attention_exact import attention_exact_paged, attention_exact_varlen
from rlcu.ops.matmul_invariant import mm


def tiny_model(device="cpu", seed=0, exact=False, **shape):
    """A random fp32 Qwen3 (no transformers import: the oracle here is the model itself),
    norm weights randomised too so that every parameter matters; in exact mode or not."""
    cfg = Qwen3Config(**{"num_hidden_layers": 2, "max_position_embeddings": 512, "tie_word_embeddings": False,
                         "rope_theta": 10000.0, "eos_token_id": None, "bos_token_id": None, **shape})
    m = Qwen3.from_config(cfg, seed=seed, init_std=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, v in m.w.items():
        if name.endswith("norm"):
            v.add_(0.1 * torch.randn(v.shape, generator=gen))
    if device != "cpu":
        m = Qwen3(cfg, m.flat.to(device))
    m.exact = exact
    return m


def sample(llm, prompts, sp) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, completion tokens, the engine's logprobs) of every completion of `prompts`
    (token lists) sampled by `llm` under `sp`, prompt by prompt and sample by sample."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(p, c.token_ids, c.logprobs) for p, o in zip(prompts, outs) for c in o.outputs]


def forward_logprobs(m, gens, temperature: float) -> list[torch.Tensor]:
    """The trainer's forward over `gens`' sequences (sample's output) packed in one batch on m's
    device: each completion's logprobs at its sampled tokens (float32, CPU), to set beside the
    engine's, which exact mode makes equal bit for bit."""
    seqs = [p + t for p, t, _ in gens]
    tokens = torch.tensor([x for s in seqs for x in s], device=m.device)
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32,
                      device=m.device)
    lp = m.forward(tokens, cu, temperature=temperature, grad=False).float().cpu()
    starts = cu[:-1].tolist()
    return [lp[s + len(p):s + len(p) + len(t)] for (p, t, _), s in zip(gens, starts)]


def assert_engine_is_trainer(m, gens, temperature: float) -> None:
    """Every sampled token's engine logprob equals the trainer's forward bit for bit."""
    for k, ((_, _, lps), want) in enumerate(zip(gens, forward_logprobs(m, gens, temperature))):
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), want), k


def mm_rows_check():
    """The batch-invariant GEMM: a row's bits do not depend on the rows beside it (K = 37: a
    masked last K tile), in place too."""
    torch.manual_seed(0)
    x, w, c = torch.randn(41, 37), torch.randn(29, 37), torch.randn(41, 29)
    full = mm(x, w, c)
    assert (full - torch.addmm(c, x, w.t())).abs().max() < 1e-4
    for lo, hi in ((0, 1), (3, 4), (5, 22), (40, 41)):
        assert torch.equal(mm(x[lo:hi], w, c[lo:hi]), full[lo:hi])
    y = c.clone()
    mm(x, w, y, out=y)  # in place on c, as the engine's residual
    assert torch.equal(y, full)


def attention_chunks_check():
    """Exact attention: a sequence packed with others, alone, decoded token by token from
    scattered cache blocks and as a paged prefill chunk gives the same bits."""
    torch.manual_seed(0)
    Hq, Hk, D, BS, scale = 6, 2, 20, 4, 20**-0.5
    lens = [13, 21, 5]
    N = sum(lens)
    cu = torch.tensor([0, 13, 34, 39], dtype=torch.int32)
    q, k, v = torch.randn(N, Hq, D), torch.randn(N, Hk, D), torch.randn(N, Hk, D)
    o, lse = attention_exact_varlen(q, k, v, cu, 21, scale)
    o_ref, lse_ref = attention_fwd_ref(q, k, v, cu, 21, scale)
    assert (o - o_ref).abs().max() < 1e-5 and (lse - lse_ref).abs().max() < 1e-5
    alone, _ = attention_exact_varlen(q[13:34], k[13:34], v[13:34], torch.tensor([0, 21], dtype=torch.int32),
                                      21, scale)
    assert torch.equal(alone, o[13:34])
    blocks = [7, 2, 11, 0, 5, 9]  # sequence 1 in scattered cache blocks
    kc, vc = torch.zeros(16, BS, Hk, D), torch.zeros(16, BS, Hk, D)
    for p in range(21):
        kc[blocks[p // BS], p % BS], vc[blocks[p // BS], p % BS] = k[13 + p], v[13 + p]
    bt = torch.tensor([blocks], dtype=torch.int32)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for L in (1, 4, 5, 16, 17, 21):  # decode at every kind of position
        od = attention_exact_paged(q[12 + L:13 + L], kc, vc, bt, one, torch.tensor([L], dtype=torch.int32), 1, scale)
        assert torch.equal(od[0], o[12 + L])
    chunk = attention_exact_paged(q[19:28], kc, vc, bt, torch.tensor([0, 9], dtype=torch.int32),
                                  torch.tensor([15], dtype=torch.int32), 9, scale)  # a prefill chunk
    assert torch.equal(chunk, o[19:28])
