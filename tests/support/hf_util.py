"""Helpers shared by tests: tiny random Qwen3 checkpoints made with transformers (the oracle)."""

from __future__ import annotations

import torch


def tiny_hf_config(tied: bool = False, **kw):
    from transformers import Qwen3Config as HFConfig

    d = dict(vocab_size=333, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
             rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=tied,
             attn_implementation="eager")
    d.update(kw)
    return HFConfig(**d)


def make_hf_model(tmp_path, tied=False, seed=0, **kw):
    """A tiny random HF Qwen3ForCausalLM saved under tmp_path; returns (model, folder).
    Norm weights are randomised too so that every parameter matters."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(tied, **kw)
    m = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    folder = tmp_path / ("hf_tied" if tied else "hf_untied")
    m.save_pretrained(folder)
    return m, folder


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# the families beside Qwen3 (model/family.py) at odd shapes: hidden 96, 6 heads over 2 KV, head_dim 16
FAMILY_CASES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    # Llama 3.1's rope scaling, over a short original context so that every band of pairs is hit
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    # Qwen2.5's long-context YaRN (mscale on cos and sin)
    "qwen2.5-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
}


def make_family_model(tmp_path, case: str, seed=0, **kw):
    """A tiny random HF model of one FAMILY_CASES family saved under tmp_path/case; returns
    (model, folder). Norms and biases are randomised too, so that every parameter matters."""
    import transformers

    cfg_cls, model_cls, extra = FAMILY_CASES[case]
    torch.manual_seed(seed)
    d = dict(vocab_size=333, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             rope_theta=10000.0, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             attn_implementation="eager", **extra)
    d.update(kw)
    if "rope_parameters" in d:
        del d["rope_theta"]
    m = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**d)).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
    folder = tmp_path / case
    m.save_pretrained(folder)
    return m, folder


# Qwen3-MoE at odd shapes: 5 experts, top 2 (renormalised), layer 1 dense (mlp_only_layers)
MOE_CASE = dict(vocab_size=333, hidden_size=96, intermediate_size=160, moe_intermediate_size=48,
                num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                tie_word_embeddings=False, attn_implementation="eager")


def make_moe_model(tmp_path, seed=0, name="moe", **kw):
    """A tiny random HF Qwen3MoeForCausalLM (MOE_CASE with kw) saved under tmp_path/name;
    returns (model, folder). Norms randomised too; the routers larger than the rest, so that
    the routing is decisive and some experts get no token."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    d = dict(MOE_CASE, **kw)
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**d)).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else
                    (0.5 if n.endswith("gate.weight") else 0.05) * torch.randn_like(p))
    folder = tmp_path / name
    m.save_pretrained(folder)
    return m, folder


# the reward models' families as HF's sequence classification: Qwen3, Qwen2 (biases, YaRN), Llama (tied), Mistral
SEQ_CLS_CASES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
                 **{k: FAMILY_CASES[k] for k in ("qwen2.5-yarn", "llama-tied", "mistral")}}


def make_seq_cls_model(tmp_path, case: str, seed=0, pad_token_id=0):
    """A tiny random HF `...ForSequenceClassification` (one label, `pad_token_id`) of a SEQ_CLS_CASES
    family saved under tmp_path/case-rm; returns (model, folder). Every parameter randomised."""
    import transformers

    cfg_cls, model_cls, extra = SEQ_CLS_CASES[case]
    torch.manual_seed(seed)
    d = dict(vocab_size=333, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             rope_theta=10000.0, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             attn_implementation="eager", num_labels=1, pad_token_id=pad_token_id, **extra)
    if "rope_parameters" in d:
        del d["rope_theta"]
    cls = getattr(transformers, model_cls.replace("ForCausalLM", "ForSequenceClassification"))
    m = cls(getattr(transformers, cfg_cls)(**d)).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
    folder = tmp_path / f"{case}-rm"
    m.save_pretrained(folder)
    return m, folder


def hf_scores(hf, seqs: list[list[int]], pad: int = 0) -> torch.Tensor:
    """HF's scores of token sequences, one right-padded batch with its attention mask."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return hf(input_ids=ids, attention_mask=mask).logits[:, 0]
