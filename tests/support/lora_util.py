"""Helpers the LoRA tests share: a tiny HF model of a family and the same model in rlcu with a
random adapter attached (A and B both random, so the adapter matters), its PEFT twin loaded from
rlcu's save, and the packed-logprob loss both sides compute."""

from __future__ import annotations

import torch

import rlcu
from rlcu.model.lora import LoraAdapters, LoraConfig
from rlcu.model.lora_peft import peft_tensors, save_adapter
from support.hf_util import make_family_model, make_hf_model


def base_pair(tmp_path, family: str, seed: int = 0):
    """(hf model, its folder): Qwen3 (hf_util's, head_dim 24) or a FAMILY_CASES family (head_dim 16)."""
    if family == "qwen3":
        return make_hf_model(tmp_path, seed=seed)
    return make_family_model(tmp_path, family, seed=seed)


def random_adapter(model, cfg: LoraConfig, seed: int = 1) -> LoraAdapters:
    """An adapter set for `model` with A and B drawn N(0, 0.1), attached."""
    ad = LoraAdapters.create(model.cfg, cfg, model.device, model.dtype)
    g = torch.Generator().manual_seed(seed)
    ad.flat.copy_(torch.randn(ad.flat.shape, generator=g) * 0.1)
    return ad.attach(model)


def peft_twin(hf, ad: LoraAdapters, folder):
    """The PEFT model of `hf` with rlcu's adapter, through rlcu's save and PEFT's load."""
    from peft import PeftModel

    save_adapter(ad, folder)
    return PeftModel.from_pretrained(hf, folder, is_trainable=True).eval()


def packed_batch(seed: int = 0, lens=(23, 1, 9), vocab: int = 333):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, torch.cat(seqs), cu, torch.randn(sum(lens), generator=g)


def hf_packed_loss(hf, seqs, cu, w, temperature: float = 0.8):
    """sum over tokens of w * log p(token | its sequence's earlier tokens), by autograd."""
    total = 0.0
    for i, s in enumerate(seqs):
        a, b = int(cu[i]), int(cu[i + 1])
        lp = (hf(s[None]).logits[0] / temperature).log_softmax(-1)[:-1].gather(1, s[1:, None])[:, 0]
        total = total + (w[a + 1 : b] * lp).sum()
    return total


def adapter_grads(ad: LoraAdapters) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, HF module) -> (dA, dB) views of the adapter's gradient buffer."""
    return peft_tensors(LoraAdapters(ad.layout.model_cfg, ad.cfg, ad.grad_flat))


def peft_grads(pm) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for n, p in pm.named_parameters():
        if "lora_A" in n:
            i, name = int(n.split(".layers.")[1].split(".")[0]), n.split(".lora_A")[0].rsplit(".", 1)[1]
            pb = pm.get_parameter(n.replace("lora_A", "lora_B"))
            out[(i, name)] = (p.grad, pb.grad)
    return out


def rlcu_model(folder):
    return rlcu.from_pretrained(folder)
