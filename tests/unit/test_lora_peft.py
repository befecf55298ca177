"""LoRA adapters in PEFT's format both ways, and merged, against PEFT on transformers (fp32, CPU):
a PEFT save loads into rlcu with PEFT's logits (Qwen3, Qwen2 with bias, tied Llama; rslora), rlcu's
save reloads bit for bit, a merge equals PEFT's merge_and_unload (in place, as a folder transformers
loads, and through `rlcu merge`), and the options rlcu does not compute are refused by name."""

import json

import pytest
import torch
from support.hf_util import rel_err
from support.lora_util import base_pair, random_adapter, rlcu_model

from rlcu.cli import main as cli_main
from rlcu.model.lora import LoraConfig
from rlcu.model.lora_peft import load_adapter, merge_into, save_adapter, save_merged

peft = pytest.importorskip("peft")


def _peft_folder(hf, tmp_path, **kw):
    """A PEFT adapter on `hf` with random A and B (init_lora_weights=False), saved; (peft model, folder)."""
    torch.manual_seed(11)
    pcfg = peft.LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **kw)
    pm = peft.get_peft_model(hf, pcfg).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    folder = tmp_path / "peft_adapter"
    pm.save_pretrained(folder)
    return pm, folder


@pytest.mark.parametrize("family,kw", [
    ("qwen3", dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj"])),
    ("qwen2", dict(r=4, lora_alpha=6, target_modules="all-linear", use_rslora=True)),
    ("llama-tied", dict(r=2, lora_alpha=2, target_modules=["down_proj", "k_proj", "up_proj"])),
])
def test_peft_save_loads_into_rlcu_with_peft_logits(tmp_path, family, kw):
    hf, folder = base_pair(tmp_path, family)
    ids = torch.randint(0, 333, (2, 21))
    with torch.no_grad():
        base = hf(ids).logits
    pm, adapter = _peft_folder(hf, tmp_path, **kw)
    m = rlcu_model(folder)
    ad = load_adapter(adapter, m.cfg).attach(m)
    assert ad.cfg.rslora == kw.get("use_rslora", False) and ad.cfg.r == kw["r"]
    assert ad.num_params() == sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    with torch.no_grad():
        ref = pm(ids).logits
    assert rel_err(ref, base) > 1e-2 and rel_err(m.logits(ids), ref) < 1e-5
    out = tmp_path / "resaved"
    save_adapter(ad, out)
    assert torch.equal(load_adapter(out, m.cfg).flat, ad.flat)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_merge_equals_peft_merge_and_unload(tmp_path, family):
    hf, folder = base_pair(tmp_path, family)
    m = rlcu_model(folder)
    ad = random_adapter(m, LoraConfig(r=3, alpha=5, rslora=True, target_modules="all-linear"))
    save_adapter(ad, tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
    merged_hf = pm.merge_and_unload().eval()
    ids = torch.randint(0, 333, (2, 17))
    with torch.no_grad():
        ref = merged_hf(ids).logits
    adapted = m.logits(ids)
    save_merged(m, tmp_path / "merged")
    assert m.lora is ad  # save_merged leaves the model unmerged
    reloaded = type(merged_hf).from_pretrained(tmp_path / "merged", attn_implementation="eager").float().eval()
    with torch.no_grad():
        assert rel_err(reloaded(ids).logits, ref) < 1e-5
    merge_into(m)
    assert m.lora is None and m.trains_base
    for n, p in merged_hf.named_parameters():
        assert rel_err(m.params[n], p) < 1e-6, n
    assert rel_err(m.logits(ids), adapted) < 1e-5
    out = tmp_path / "cli_merged"
    assert cli_main(["merge", str(folder), str(tmp_path / "adapter"), str(out), "--dtype", "float32"]) == 0
    assert torch.equal(rlcu_model(out).flat, m.flat)


def _write(folder, cfg: dict, tensors=None):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("field,value,msg", [
    ("use_dora", True, "use_dora True is not supported"),
    ("bias", "lora_only", "bias 'lora_only' is not supported"),
    ("modules_to_save", ["lm_head"], "modules_to_save .* must be empty"),
    ("rank_pattern", {"q_proj": 8}, "rank_pattern"),
    ("layers_to_transform", [0], "layers_to_transform"),
    ("target_modules", ".*proj", "regular expression"),
    ("target_modules", ["q_proj", "lm_head"], "target_modules 'lm_head' is not supported"),
    ("peft_type", "LOHA", "peft_type 'LOHA'"),
    ("lora_alpha", 0, "lora.alpha must be"),
])
def test_unsupported_adapters_are_refused_by_field(tmp_path, field, value, msg):
    from rlcu.model.config import CausalLMConfig

    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none", field: value}
    _write(tmp_path / "a", cfg)
    with pytest.raises(ValueError, match=msg):
        load_adapter(tmp_path / "a", CausalLMConfig(num_hidden_layers=1))


def test_adapter_tensors_are_checked(tmp_path):
    from rlcu.model.config import CausalLMConfig

    mc = CausalLMConfig(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                        num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    _write(tmp_path / "a", cfg, {key.format("A"): torch.zeros(2, 48)})
    with pytest.raises(ValueError, match="missing tensor.*lora_B"):
        load_adapter(tmp_path / "a", mc)
    _write(tmp_path / "b", cfg, {key.format("A"): torch.zeros(2, 48), key.format("B"): torch.zeros(48, 3)})
    with pytest.raises(ValueError, match=r"has shape \[48, 3\], r=2 .* \[48, 2\]"):
        load_adapter(tmp_path / "b", mc)
    nan = torch.full((2, 48), float("nan"))
    _write(tmp_path / "c", cfg, {key.format("A"): nan, key.format("B"): torch.zeros(48, 2)})
    with pytest.raises(ValueError, match="non-finite"):
        load_adapter(tmp_path / "c", mc)
    _write(tmp_path / "d", cfg)
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors"):
        load_adapter(tmp_path / "d", mc)
    assert cli_main(["merge", str(tmp_path / "nowhere"), str(tmp_path / "d"), str(tmp_path / "o")]) == 2
