"""LoRA on a Qwen3-MoE's experts (model/lora.py ExpertSpec, ops/moe.py ExpertLora) against PEFT 0.21
on transformers 5 (the autograd oracle), fp32 on the CPU at odd shapes (5 experts top 2, one dense
layer, r = 3): the logits and every adapter gradient (attention's and each expert's A_e, B_e)
through checkpointing, in PEFT's format both ways (rlcu's save loads into PEFT; PEFT's own adapter,
its v4 names converted to target_parameters, loads into rlcu), merged, and the refusals by name."""

import pytest
import torch
from support.hf_util import MOE_CASE, make_moe_model, rel_err
from support.lora_util import hf_packed_loss, packed_batch, peft_twin, random_adapter

import rlcu
from rlcu.model.lora import LoraAdapters, LoraConfig
from rlcu.model.lora_peft import expert_tensors, load_adapter, merge_into, peft_key, peft_tensors, save_adapter, to_peft

peft = pytest.importorskip("peft")


def _named(ad: LoraAdapters) -> dict:
    """PEFT's saved name -> the tensor in PEFT's shape, of an adapter's buffer."""
    out = {peft_key(i, n, ab): t for (i, n), AB in peft_tensors(ad).items() for ab, t in zip("AB", AB)}
    out.update({k: to_peft(t, ab) for k, (t, ab) in expert_tensors(ad).items()})
    return out


def test_expert_adapters_match_peft_logits_and_grads(tmp_path):
    hf, folder = make_moe_model(tmp_path, seed=3)
    m = rlcu.from_pretrained(folder)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"]
    ad = random_adapter(m, LoraConfig(r=3, alpha=5, target_modules=names))  # PEFT's all-linear: the router too
    ex = ad.layout.experts
    assert sorted(ex) == [0, 2] and {m_ for (i, m_) in ad.layout.specs} == {"qkv", "o", "router"}  # 1: dense
    assert ex[0].gate_up[0].shape == (5, 6, 96) and ex[0].down[1].shape == (5, 96, 3)
    pm = peft_twin(hf, ad, tmp_path / "adapter")
    assert ad.num_params() == sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    ids = torch.randint(0, 333, (2, 19))
    with torch.no_grad():
        ref = pm(ids).logits
    assert rel_err(m.logits(ids), ref) < 1e-5
    seqs, tokens, cu, w = packed_batch()
    pm.zero_grad()
    hf_packed_loss(pm, seqs, cu, w).backward()
    want = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if "lora_" in n}
    for ckpt in (True, False):
        m.gradient_checkpointing = ckpt
        m.zero_grad()
        m.forward(tokens, cu, temperature=0.8)
        m.backward(w)
        got = _named(LoraAdapters(ad.layout.model_cfg, ad.cfg, ad.grad_flat))
        assert sorted(got) == sorted(want) and any("experts.base_layer" in k for k in got)
        assert any(".mlp.gate.lora_B" in k for k in got)
        for k, g in want.items():
            assert rel_err(got[k], g) < 1e-4, (ckpt, k)
    assert m.grad_flat is None  # the base frozen
    merged = rlcu.from_pretrained(folder)
    merge_into(merged, ad)
    assert rel_err(merged.logits(ids), ref) < 1e-5


def test_peft_expert_adapter_loads_into_rlcu_and_back(tmp_path):
    """A PEFT user's adapter (v4 names, which PEFT 0.21 turns into target_parameters gate_up_proj at
    rank 2r, alpha 2 alpha, and down_proj; rslora, whose scale then differs between the two) loads
    with PEFT's logits and saves back bit for bit; so does PEFT's all-linear, which adds the router
    (target_parameters gate.weight: rlcu's "gate"); refusals by name."""
    hf, folder = make_moe_model(tmp_path, seed=4)
    torch.manual_seed(5)
    pcfg = peft.LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, task_type="CAUSAL_LM", use_rslora=True,
                           target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = peft.get_peft_model(hf, pcfg).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    pm.save_pretrained(tmp_path / "peft")
    m = rlcu.from_pretrained(folder)
    ad = load_adapter(tmp_path / "peft", m.cfg).attach(m)
    assert ad.cfg.target_modules == ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ids = torch.randint(0, 333, (2, 17))
    with torch.no_grad():
        ref = pm(ids).logits
    assert rel_err(m.logits(ids), ref) < 1e-5
    save_adapter(ad, tmp_path / "resaved")
    assert torch.equal(load_adapter(tmp_path / "resaved", m.cfg).flat, ad.flat)
    hf2, _ = make_moe_model(tmp_path, seed=4, name="moe2")
    pa = peft.get_peft_model(hf2, peft.LoraConfig(r=2, lora_alpha=5, init_lora_weights=False,
                                                 target_modules="all-linear")).eval()
    pa.save_pretrained(tmp_path / "all")
    m.lora = None
    ad = load_adapter(tmp_path / "all", m.cfg).attach(m)  # PEFT's all-linear: attention, experts, router
    assert ad.cfg.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "gate")
    with torch.no_grad():
        assert rel_err(m.logits(ids), pa(ids).logits) < 1e-5
    with pytest.raises(ValueError, match="'gate' names"):
        LoraAdapters.create(rlcu.CausalLMConfig(**{k: v for k, v in MOE_CASE.items() if k not in
                                                   ("attn_implementation", "num_experts", "num_experts_per_tok",
                                                    "norm_topk_prob", "mlp_only_layers", "moe_intermediate_size")}),
                            LoraConfig(r=2, target_modules=["gate"]))
    with pytest.raises(ValueError, match="gate_proj and up_proj"):
        LoraAdapters.create(m.cfg, LoraConfig(r=2, target_modules=["gate_proj"]))
    with pytest.raises(ValueError, match="lora.dropout"):
        LoraAdapters.create(m.cfg, LoraConfig(r=2, dropout=0.1))


def test_the_memory_model_counts_the_expert_adapters():
    """rlcu.memory's adapter parts are the buffers a MoE's adapters allocate, experts included (every
    expert's A_e and B_e: far more than the attention's)."""
    from rlcu.memory import AdapterShape, JobShape, parts


    cfg = rlcu.CausalLMConfig(**{k: v for k, v in MOE_CASE.items() if k != "attn_implementation"},
                              family="qwen3_moe")
    attn = JobShape(cfg, adapter=AdapterShape(r=3, target_modules=["q_proj", "o_proj"]))
    full = JobShape(cfg, adapter=AdapterShape(r=3, target_modules="all-linear"))
    ad = LoraAdapters.create(cfg, LoraConfig(r=3, target_modules="all-linear"))
    assert ad.flat.numel() == parts.adapter_params(full) > 3 * parts.adapter_params(attn)
    assert parts.adapter_params(JobShape(cfg, adapter=AdapterShape(r=3, target_modules=["down_proj"]))) > 0
