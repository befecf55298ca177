"""Exact mode (ops/exact.py) on the CPU twins in fp32: bit-for-bit equality (torch.equal,
tolerance 0) of the engine's sampled-token logprobs with Qwen3.forward's, and of every output
across batch compositions: a sequence alone or packed with others, decode against the packed
training forward, chunked prefill, preemption and recompute, prefix sharing and n > 1, any
max_num_seqs. The ops underneath (the GEMM, attention, the head) are checked alone too. The
mode is the model's (`Qwen3.exact`): two models of one process, one in each mode, each compute
as their own mode does."""

import pytest
import torch
from support.exact_util import attention_chunks_check, mm_rows_check, tiny_model

from rlcu.engine import LLM, SamplingParams
from rlcu.ops.exact import tree_sum
from rlcu.ops.logprob import logprob_fwd, token_logprob
from rlcu.ops.matmul_invariant import mm

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# odd shapes: 7 query heads over 1 KV head (G = 7), head dim 20, vocabulary 257
SHAPE = {"vocab_size": 257, "hidden_size": 56, "intermediate_size": 90, "num_attention_heads": 7,
             "num_key_value_heads": 1, "head_dim": 20}
PROMPTS = [[5, 17, 3], list(range(40, 61)), [7] * 9, [100 + (i * 37) % 150 for i in range(30)], [1]]
SP = SamplingParams(n=2, temperature=0.8, max_tokens=8, ignore_eos=True, seed=11, logprobs=True)




@pytest.fixture(scope="module")
def model():
    return tiny_model(**SHAPE)


@pytest.fixture(scope="module")
def exact():
    """The same weights as `model`'s, in exact mode."""
    return tiny_model(exact=True, **SHAPE)


def _packed(seqs):
    tokens = torch.tensor([t for s in seqs for t in s])
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    return tokens, cu


def _generate(model, prompts, sp=SP, **engine):
    llm = LLM(model, enforce_eager=True, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs], llm


def test_tree_sum_ignores_zero_padding():
    x = torch.randn(5, 37)
    pad = torch.cat([x, torch.zeros(5, 91)], 1)
    assert torch.equal(tree_sum(x), tree_sum(pad))
    assert torch.allclose(tree_sum(x), x.sum(-1), atol=1e-5)


def test_mm_rows_do_not_depend_on_the_batch():
    mm_rows_check()


def test_attention_decode_and_chunks_equal_packed_training():
    attention_chunks_check()


def test_token_logprob_equals_the_trainer_head():
    torch.manual_seed(0)
    h, W = torch.randn(23, 40), torch.randn(257, 40)
    tgt = torch.randint(0, 257, (23,))
    lp, _, _ = logprob_fwd(h, W, tgt, 0.7, exact=True)
    for lo, hi in ((0, 23), (4, 5), (10, 17)):
        got = token_logprob(mm(h[lo:hi], W), tgt[lo:hi], torch.full((hi - lo,), 0.7))
        assert torch.equal(got, lp[lo:hi])


def test_forward_is_batch_invariant(exact):
    model = exact
    torch.manual_seed(1)
    seqs = [torch.randint(0, 257, (n,)).tolist() for n in (13, 29, 7, 40)]
    tokens, cu = _packed(seqs)
    lp = model.forward(tokens, cu, temperature=0.7, grad=False)
    lp_e, _ = model.forward(tokens, cu, temperature=0.7, return_entropy=True, grad=False)
    assert torch.equal(lp_e, lp)
    for i, s in enumerate(seqs):
        for L in {len(s), 2, len(s) // 2 + 1}:  # alone, and every prefix of it
            t1, c1 = _packed([s[:L]])
            assert torch.equal(model.forward(t1, c1, temperature=0.7, grad=False), lp[cu[i]:cu[i] + L])


def _assert_engine_equals_forward(model, gens, prompts, n, temperature):
    seqs = [p + toks for p, (toks, _) in zip([p for p in prompts for _ in range(n)], gens)]
    tokens, cu = _packed(seqs)
    lp = model.forward(tokens, cu, temperature=temperature, grad=False)
    for k, (p, (toks, lps)) in enumerate(zip([p for p in prompts for _ in range(n)], gens)):
        start = int(cu[k]) + len(p)
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), lp[start:start + len(toks)]), k


@pytest.mark.parametrize("engine", [
    {"num_kv_blocks": 64},
    {"num_kv_blocks": 80, "block_size": 4, "max_num_batched_tokens": 7},  # chunked prefill mixed with decode
    {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 64},  # preemption and recompute
    {"num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 3},  # a few sequences a step
], ids=["plain", "chunked", "preempt", "max_num_seqs"])
def test_engine_logprobs_equal_forward_and_do_not_depend_on_batching(exact, engine):
    model = exact
    gens, llm = _generate(model, PROMPTS, **engine)
    _assert_engine_equals_forward(model, gens, PROMPTS, SP.n, SP.temperature)
    if engine["num_kv_blocks"] == 12:
        assert llm.stats["preemptions"] > 0
    alone = [g for p in PROMPTS for g in _generate(model, [p], num_kv_blocks=64)[0]]
    assert gens == alone  # tokens and logprobs, each request alone vs in this engine's batches


def test_engine_and_trainer_run_one_layer_function(exact, monkeypatch):
    """The agreement by construction: a prefill and its decodes in the engine, and the trainer's
    forward over the same tokens, all run model/layer.py's layer_fwd (counted through a wrapper),
    with the batch-invariant kernels (the engine over its paged cache, the trainer over packed
    K/V), and the engine's sampled-token logprobs are the trainer's bit for bit."""
    import rlcu.model.layer as layer
    from rlcu.engine.paged_forward import PagedKV

    calls, layer_fwd = [], layer.layer_fwd

    def counting(model, i, x, pos, kv, ops, keep="none", lora=None, **kw):
        calls.append((type(kv), x.shape[0], isinstance(ops, layer.Kernels) and ops.gemm_exact))
        return layer_fwd(model, i, x, pos, kv, ops, keep, lora, **kw)

    monkeypatch.setattr(layer, "layer_fwd", counting)
    prompt, L = PROMPTS[3], exact.cfg.num_hidden_layers
    sp = SamplingParams(n=1, temperature=0.9, max_tokens=6, ignore_eos=True, seed=5, logprobs=True)
    gens, _ = _generate(exact, [prompt], sp, num_kv_blocks=64, block_size=4)
    assert calls == [(PagedKV, len(prompt), True)] * L + [(PagedKV, 1, True)] * (L * 5)  # prefill, 5 decodes
    calls.clear()
    _assert_engine_equals_forward(exact, gens, [prompt], 1, sp.temperature)
    assert calls == [(layer.Packed, len(prompt) + 6, True)] * L


def test_prefix_sharing_and_many_samples(exact):
    """n = 5 forks of one prompt (shared blocks, copy-on-write); then, one sequence a step, a
    second request whose first 36 tokens come from the first's cached blocks."""
    model = exact
    a, b = list(range(3, 40)), list(range(3, 40)) + [9, 9]
    sp = SamplingParams(n=5, temperature=1.0, max_tokens=5, ignore_eos=True, seed=2, logprobs=True)
    gens, _ = _generate(model, [a, b], sp, num_kv_blocks=64, block_size=4)
    _assert_engine_equals_forward(model, gens, [a, b], 5, 1.0)
    sp1 = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=2, logprobs=True)
    gens, llm = _generate(model, [a, b], sp1, num_kv_blocks=64, block_size=4, max_num_seqs=1)
    assert llm.stats["cached_tokens"] == 36
    _assert_engine_equals_forward(model, gens, [a, b], 1, 1.0)


def _engine_vs_forward(model, gens, prompts=PROMPTS, n=SP.n, temperature=SP.temperature) -> torch.Tensor:
    """|the engine's logprob - Qwen3.forward's| of every sampled token of `gens`."""
    seqs = [p + t for p, (t, _) in zip([p for p in prompts for _ in range(n)], gens)]
    tokens, cu = _packed(seqs)
    lp = model.forward(tokens, cu, temperature=temperature, grad=False)
    diffs = [lp[int(cu[k]) + len(p):int(cu[k]) + len(p) + len(t)] - torch.tensor(lps)
             for k, (p, (t, lps)) in enumerate(zip([p for p in prompts for _ in range(n)], gens))]
    return torch.cat(diffs).abs()


def test_default_mode_is_not_exact(model):
    """The point of the mode: the default engine's logprobs are not the trainer's bits."""
    assert not model.exact
    d = _engine_vs_forward(model, _generate(model, PROMPTS, num_kv_blocks=64)[0])
    assert d.max() < 1e-4 and (d > 0).any()


def test_two_models_each_in_its_own_mode(model, exact, monkeypatch):
    """Two models of one process, the same weights, one in exact mode and one not, used in turns
    (their engines, forwards and heads): each runs its own mode's path (the batch-invariant
    GEMM in every forward of the exact one, never in the default one's) and gets its mode's
    bits, with nothing process-wide to switch between them."""
    import rlcu.engine.paged_forward as pf
    import rlcu.model.causal_lm as q3
    import rlcu.model.layer as layer
    import rlcu.ops.logprob as lpm

    assert exact.exact and not model.exact and torch.equal(exact.flat, model.flat)
    calls = []
    for mod in (layer, q3, pf, lpm):  # the invariant GEMM where the layer, the heads and logprob call it
        monkeypatch.setattr(mod, "mm_invariant",
                            lambda *a, f=mod.mm_invariant, **k: (calls.append(1), f(*a, **k))[1])

    def runs(m, fn):
        n = len(calls)
        out = fn(m)
        return out, len(calls) - n

    ids = torch.tensor([PROMPTS[3]])
    cu = torch.tensor([0, ids.shape[1]], dtype=torch.int32)
    for _ in range(2):  # in turns: the second round finds each model as the first left it
        (gens_e, _), n_e = runs(exact, lambda m: _generate(m, PROMPTS, num_kv_blocks=64))
        (gens_d, _), n_d = runs(model, lambda m: _generate(m, PROMPTS, num_kv_blocks=64))
        d_e, n_fe = runs(exact, lambda m: _engine_vs_forward(m, gens_e))
        d_d, n_fd = runs(model, lambda m: _engine_vs_forward(m, gens_d))
        assert n_e > 0 and n_fe > 0 and n_d == 0 and n_fd == 0
        assert d_e.max() == 0 and d_d.max() < 1e-4 and (d_d > 0).any()
        for m, head in ((exact, lambda h, W: mm(h, W)), (model, lambda h, W: h @ W.t())):  # each its own head
            h = m.hidden_forward(ids[0], cu, grad=False)
            assert torch.equal(m.logits(ids)[0], head(h, m.lm_head).float())
    h_e, h_d = exact.hidden_forward(ids[0], cu, grad=False), model.hidden_forward(ids[0], cu, grad=False)
    assert not torch.equal(h_e, h_d) and (h_e - h_d).abs().max() < 1e-4


def test_llm_of_a_path_in_exact_mode(model, tmp_path):
    """`rlcu.LLM(path, exact=True)`, for the engine alone: the model it loads is in exact mode,
    and the engine's logprobs are its forward's bit for bit; a given model keeps its own mode."""
    model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, exact=True, enforce_eager=True, num_kv_blocks=64)
    assert llm.model.exact and not LLM(tmp_path, num_kv_blocks=64).model.exact
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
    gens = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
    assert _engine_vs_forward(llm.model, gens).max() == 0
    assert not LLM(model, num_kv_blocks=64).model.exact
    with pytest.raises(ValueError, match="LLM.exact must be True, False or None, got 1"):
        LLM(model, exact=1)


def test_grpo_exact_config_first_ratio_is_one(tmp_path, monkeypatch):
    """`exact: true` in a GRPO config: at the first update (the policy that sampled) the
    trainer's logprob of every completion token is the engine's sampling logprob, bit for bit,
    so the PPO ratio is exactly 1; in the default mode it is not."""
    import rlcu.train.policy_pass as rt  # the micro-batch pass calls the fused policy loss
    from rlcu.config import GRPOConfig, _build
    from rlcu.data import synthetic as syn
    from rlcu.train.grpo import GRPOTrainer

    tok = syn.make_tokenizer()
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 32, "tie_word_embeddings": True,
            "rope_theta": 10000.0, "bos_token_id": None, "vocab_size": tok.vocab_size,
            "eos_token_id": tok.eos_token_id}

    def _trainer(out, **kw):
        cfg = _build(GRPOConfig, {
            "model": {"tiny": tiny, "init_seed": 3}, "steps": 1, "prompts_per_step": 4, "group_size": 4,
            "max_new_tokens": 4, "micro_batch_tokens": 64, "optim": {"lr": 3e-3},
            "rewards": [{"fn": "rlcu.data.synthetic:exact_match_reward"}], "engine": {"block_size": 16}, "seed": 5,
            "log": {"out_dir": str(out), "progress": False, "tensorboard": False, "plot": False},
            "checkpoint": {"save_at_end": False}, **kw})
        return GRPOTrainer(cfg, syn.sort_rows(64, "train", min_len=2, max_len=3), tokenizer=tok)

    seen = []

    def spy(lp, old_lp, ref, adv, w, *a, **kw):
        seen.append((lp.clone(), old_lp.clone(), w > 0))
        return policy_loss(lp, old_lp, ref, adv, w, *a, **kw)

    policy_loss = rt.policy_loss
    monkeypatch.setattr(rt, "policy_loss", spy)
    for exact_on in (True, False):
        seen.clear()
        tr = _trainer(tmp_path / str(exact_on), exact=exact_on, temperature=0.9)
        assert tr.model.exact == exact_on and tr.llm.model is tr.model
        tr.train()
        lp, old, on = (torch.cat(x) for x in zip(*seen))
        assert on.sum() > 20
        if exact_on:
            assert torch.equal(lp[on], old[on])
        else:
            assert not torch.equal(lp[on], old[on]) and (lp[on] - old[on]).abs().max() < 1e-4


@pytest.mark.parametrize("ckpt", [True, "attention", False])
def test_exact_gradients_match_the_default_mode(ckpt):
    """The backward is the default one over the exact forward's saved tensors (attention's o and
    lse included): the same gradient up to rounding, and lp close to the default's."""
    m = tiny_model(**SHAPE)
    m.gradient_checkpointing = ckpt
    torch.manual_seed(3)
    tokens, cu = _packed([torch.randint(0, 257, (n,)).tolist() for n in (11, 30, 4)])
    grads, lps = [], []
    for on in (False, True):
        m.exact = on
        m.zero_grad()
        lp = m.forward(tokens, cu, temperature=0.9)
        m.backward(torch.linspace(-1, 1, lp.numel()))
        grads.append(m.grad_flat.clone())
        lps.append(lp)
    assert (lps[0] - lps[1]).abs().max() < 1e-5
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-5
