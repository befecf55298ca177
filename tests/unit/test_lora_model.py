"""LoRA in rlcu's model against PEFT on transformers (the autograd oracle), fp32 on the CPU, at odd
shapes (hidden 96, 6 heads over 2, r = 3): logits and packed logprobs with an adapter, the A and B
gradients of a loss on packed logprobs through every checkpointing mode, for Qwen3 (q/k norm) and
Qwen2 (q/k/v bias) and the target sets {q, v}, all-linear, {down}, rslora. The base stays frozen:
no gradient buffer, no weight gradient. Dropout's masks are the same in the recompute."""

import pytest
import torch
from support.hf_util import rel_err
from support.lora_util import (
    adapter_grads,
    base_pair,
    hf_packed_loss,
    packed_batch,
    peft_grads,
    peft_twin,
    random_adapter,
    rlcu_model,
)

from rlcu.model.lora import LoraAdapters, LoraConfig

pytest.importorskip("peft")

CASES = {
    "qv": LoraConfig(r=3, alpha=5, target_modules=["q_proj", "v_proj"]),
    "all": LoraConfig(r=3, alpha=7, target_modules="all-linear"),
    "down": LoraConfig(r=4, alpha=4, target_modules=["down_proj"]),
    "rslora": LoraConfig(r=5, alpha=3, rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_grads_match_peft(tmp_path, family, case):
    hf, folder = base_pair(tmp_path, family)
    m = rlcu_model(folder)
    ids = torch.randint(0, 333, (2, 19))
    with torch.no_grad():
        base = hf(ids).logits
    ad = random_adapter(m, CASES[case])
    pm = peft_twin(hf, ad, tmp_path / "adapter")
    with torch.no_grad():
        ref = pm(ids).logits
    assert rel_err(ref, base) > 1e-2  # the adapter matters
    assert rel_err(m.logits(ids), ref) < 1e-5
    seqs, tokens, cu, w = packed_batch()
    for ckpt in (True, "attention", False):
        m.gradient_checkpointing = ckpt
        m.zero_grad()
        lp = m.forward(tokens, cu, temperature=0.8)
        m.backward(w)
        if ckpt is True:
            pm.zero_grad()
            hf_packed_loss(pm, seqs, cu, w).backward()
            want = peft_grads(pm)
            assert abs(float((lp * w).sum()) - float(hf_packed_loss(pm, seqs, cu, w).detach())) < 1e-4
        got = adapter_grads(ad)
        assert sorted(got) == sorted(want)
        for k, (dA, dB) in want.items():
            assert rel_err(got[k][0], dA) < 1e-4 and rel_err(got[k][1], dB) < 1e-4, (ckpt, k)
        assert m.grad_flat is None and m.grads == {}  # the base is frozen
    assert all(p.grad is None or not p.requires_grad for n, p in pm.named_parameters() if "lora" not in n)


def test_fused_forward_backward_matches_separate(tmp_path):
    """RL's one-sweep head (forward_backward) gives the adapters the gradients forward + backward do."""
    _, folder = base_pair(tmp_path, "qwen3")
    m = rlcu_model(folder)
    ad = random_adapter(m, CASES["all"])
    _, tokens, cu, w = packed_batch(3)
    m.zero_grad()
    m.forward(tokens, cu)
    m.backward(w)
    sep = ad.grad_flat.clone()
    m.zero_grad()
    m.forward_backward(tokens, cu, lambda lp, ent, idx: (w[idx], None))
    assert rel_err(ad.grad_flat, sep) < 1e-6
    assert m.grad_flat is None


def test_new_adapter_is_the_base_and_peft_initialisation():
    """PEFT's default init: B zero (the adapted model is the base), A ~ U(-1/sqrt(K), 1/sqrt(K))."""
    from rlcu.model.config import CausalLMConfig

    cfg = CausalLMConfig(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    ad = LoraAdapters.create(cfg, LoraConfig(r=8, target_modules="all-linear"))
    for sp in ad.layout.specs.values():
        A, B = ad.w[sp.A.name], ad.w[sp.B.name]
        assert not B.any() and A.abs().max() <= 1 / sp.K**0.5 and A.std() > 0.4 / sp.K**0.5
        assert A.shape == (len(sp.slices) * 8, sp.K)
    # per layer, r (K + n) for q, k, v, o, gate, up, down
    assert ad.num_params() == 2 * 8 * ((48 + 48) + 2 * (48 + 16) + (48 + 48) + 3 * (48 + 80))
    assert torch.equal(LoraAdapters.create(cfg, LoraConfig(r=8, seed=3)).flat,
                       LoraAdapters.create(cfg, LoraConfig(r=8, seed=3)).flat)


@pytest.mark.parametrize("fields,msg", [
    (dict(r=0), "lora.r must be"), (dict(alpha=-1), "lora.alpha"), (dict(dropout=1.0), "lora.dropout"),
    (dict(target_modules=["q_proj", "lm_head"]), "'lm_head' is not one"), (dict(init="pissa"), "lora.init"),
])
def test_config_refusals_name_the_field(fields, msg):
    with pytest.raises(ValueError, match=msg):
        LoraConfig(**fields)


def test_dropout_masks_replay_in_the_recompute(tmp_path):
    """With dropout, a checkpointed backward recomputes each layer with the forward's masks: its
    gradients are the kept-activation backward's, and a central difference of the loss (masks fixed
    by the seed) agrees with them. Without gradients (logits, the engine) there is no dropout."""
    _, folder = base_pair(tmp_path, "qwen2")
    m = rlcu_model(folder)
    ad = random_adapter(m, LoraConfig(r=3, alpha=5, dropout=0.3, target_modules="all-linear"))
    _, tokens, cu, w = packed_batch(5)
    grads = []
    for ckpt in (True, False):
        m.gradient_checkpointing, ad._forwards = ckpt, 0
        m.zero_grad()
        lp = m.forward(tokens, cu)
        m.backward(w)
        grads.append(ad.grad_flat.clone())
    assert torch.equal(grads[0], grads[1])
    with torch.no_grad():
        lp0 = m.forward(tokens, cu, grad=False)
    assert not torch.equal(lp0, lp)  # masks on in training, off without gradients
    v = torch.randn(ad.flat.shape, generator=torch.Generator().manual_seed(0)) * (ad.grad_flat != 0)

    def loss(sign):
        ad.flat.add_(sign * 1e-3 * v)
        ad._forwards = 0
        out = float((m.forward(tokens, cu) * w).double().sum())
        ad.flat.sub_(sign * 1e-3 * v)
        return out
    fd = (loss(1) - loss(-1)) / 2e-3
    assert abs(fd - float((grads[0] * v).sum())) < 2e-2 * abs(fd)


def test_exact_mode_with_adapters_is_batch_invariant(tmp_path):
    """Exact mode applies the adapters through the grouped kernels' launches (ops/lora.py, the engine's):
    a sequence's logprobs alone equal its logprobs packed with others, bit for bit."""
    _, folder = base_pair(tmp_path, "qwen3")
    m = rlcu_model(folder)
    random_adapter(m, CASES["all"])
    seqs, tokens, cu, _ = packed_batch(7, lens=(11, 6, 14))
    default = m.forward(tokens, cu, grad=False)
    m.exact = True
    packed = m.forward(tokens, cu, grad=False)
    alone = m.forward(seqs[2], torch.tensor([0, 14], dtype=torch.int32), grad=False)
    assert torch.equal(packed[17:], alone) and rel_err(packed, default) < 1e-4


def test_a_base_gradient_sink_with_adapters_is_refused(tmp_path):
    _, folder = base_pair(tmp_path, "qwen3")
    m = rlcu_model(folder)
    random_adapter(m, CASES["qv"])
    _, tokens, cu, w = packed_batch()
    m.forward(tokens, cu)
    m.grad_sink = object()  # what rlcu.parallel sets: its buckets hold the base's gradient
    with pytest.raises(ValueError, match="make the optimizer over the adapters"):
        m.backward(w)


def test_bf16_adapters_follow_fp32(tmp_path):
    """bf16 weights and adapters (fp32 gradients, as the optimizer's default), default and exact mode:
    logprobs and adapter gradients within bf16's tolerance of the fp32 model's."""
    import rlcu

    _, folder = base_pair(tmp_path, "qwen3")
    _, tokens, cu, w = packed_batch()
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        m = rlcu.from_pretrained(folder, dtype=dt)
        ad = random_adapter(m, CASES["all"])
        for ex in (False, True):
            m.exact = ex
            m.zero_grad()
            lp = m.forward(tokens, cu)
            m.backward(w)
            out[dt, ex] = lp.float(), ad.grad_flat.clone()
    assert ad.grad_flat.dtype == torch.float32 and ad.flat.dtype == torch.bfloat16
    ref_lp, ref_g = out[torch.float32, False]
    for ex in (False, True):
        lp, g = out[torch.bfloat16, ex]
        assert rel_err(lp, ref_lp) < 1e-2 and rel_err(g, ref_g) < 6e-2, ex
