"""The families beside Qwen3 (Qwen2, Llama untied and tied, Mistral) against HF transformers, the
autograd oracle, on tiny random checkpoints at odd shapes, fp32, CPU: logits, packed logprobs,
every parameter's gradient, a save transformers reloads; config.json forms and refusals."""

import json

import pytest
import torch
from support.hf_util import FAMILY_CASES, make_family_model, rel_err

import rlcu
from rlcu.memory.parts import params
from rlcu.model.config import CausalLMConfig, Qwen3Config
from rlcu.model.layout import ParamLayout

transformers = pytest.importorskip("transformers")


@pytest.fixture(params=list(FAMILY_CASES))
def pair(request, tmp_path):
    return make_family_model(tmp_path, request.param, seed=len(request.param))


def test_logits_match_hf(pair):
    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    assert isinstance(m, rlcu.Qwen3) and m.cfg.family == hf.config.model_type
    ids = torch.randint(0, 333, (3, 29))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(m.logits(ids), ref) < 1e-5


@pytest.mark.parametrize("ckpt", [True, False])
def test_packed_logprobs_and_grads_match_hf_autograd(pair, ckpt):
    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    m.gradient_checkpointing = ckpt
    g = torch.Generator().manual_seed(0)
    lens = [23, 1, 9]
    seqs = [torch.randint(0, 333, (L,), generator=g) for L in lens]
    cu = torch.tensor([0, 23, 24, 33], dtype=torch.int32)
    tokens = torch.cat(seqs)
    w = torch.randn(tokens.numel(), generator=g)
    lp = m.forward(tokens, cu, temperature=0.8)
    m.zero_grad()
    m.backward(w)
    total = 0.0
    for i, s in enumerate(seqs):
        a, b = int(cu[i]), int(cu[i + 1])
        ref = (hf(s[None]).logits[0] / 0.8).log_softmax(-1)[:-1].gather(1, s[1:, None])[:, 0]
        assert lp[a] == 0
        if b - a > 1:
            assert rel_err(lp[a + 1 : b], ref.detach()) < 1e-5
        total = total + (w[a + 1 : b] * ref).sum()
    hf.zero_grad()
    total.backward()
    assert sorted(n for n, _ in hf.named_parameters()) == sorted(m.grads)
    for n, p in hf.named_parameters():
        assert rel_err(m.grads[n], p.grad) < 1e-4, n


def test_save_then_transformers_load(pair, tmp_path):
    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    for v in m.params.values():
        v.add_(0.01 * torch.randn_like(v))
    out = tmp_path / "saved"
    m.save_pretrained(out)
    d = json.loads((out / "config.json").read_text())
    assert d["architectures"] == [type(hf).__name__] and d["model_type"] == hf.config.model_type
    assert d["tie_word_embeddings"] == hf.config.tie_word_embeddings
    hf2 = type(hf).from_pretrained(out, attn_implementation="eager").float().eval()
    ids = torch.randint(0, 333, (2, 19))
    with torch.no_grad():
        ref = hf2(ids).logits
    assert rel_err(m.logits(ids), ref) < 1e-5
    assert torch.equal(rlcu.from_pretrained(out).flat, m.flat)


def test_layout_slots_follow_the_family():
    def slots(family):
        return {n.split(".", 2)[-1] for n in ParamLayout(CausalLMConfig(family=family, num_hidden_layers=1)).slots}
    assert {"q_norm", "k_norm"} <= slots("qwen3") and "qkv_bias" not in slots("qwen3")
    assert "qkv_bias" in slots("qwen2") and "q_norm" not in slots("qwen2")
    assert not {"qkv_bias", "q_norm", "k_norm"} & (slots("llama") | slots("mistral"))
    lay = ParamLayout(CausalLMConfig(family="qwen2", num_hidden_layers=1))
    q, kv = lay.cfg.q_size, lay.cfg.kv_size
    assert lay.hf["model.layers.0.self_attn.v_proj.bias"] == ("layers.0.qkv_bias", q + kv, q + 2 * kv)
    assert Qwen3Config is CausalLMConfig and rlcu.CausalLM is rlcu.Qwen3
    for family in ("qwen3", "qwen2", "llama"):  # the memory model counts the family's slots
        cfg = CausalLMConfig(family=family, num_hidden_layers=2)
        assert params(cfg) == ParamLayout(cfg).numel
    assert params(CausalLMConfig(family="qwen2")) > params(CausalLMConfig(family="llama"))


def _published(**kw):
    d = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
             intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu", attention_bias=False)
    d.update(kw)
    return d


def test_config_forms_and_defaults():
    c = CausalLMConfig.from_hf_dict(_published())
    assert (c.family, c.head_dim, c.tie_word_embeddings, c.rope_theta) == ("llama", 64, True, 500000.0)
    d = _published(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del d["rope_theta"], d["tie_word_embeddings"]
    c = CausalLMConfig.from_hf_dict(d)
    assert c.rope_theta == 1e6 and not c.tie_word_embeddings  # transformers' default: untied
    c = CausalLMConfig.from_hf_dict({k: v for k, v in _published(model_type="qwen2").items() if k != "architectures"})
    assert c.family == "qwen2"
    assert CausalLMConfig.from_hf_dict(c.to_hf_dict()) == c
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    c = CausalLMConfig.from_hf_dict(_published(rope_scaling=scaling))  # Llama 3.1's published form
    assert (c.rope.type, c.rope.factor, c.rope_theta) == ("llama3", 8.0, 500000.0)
    assert c.to_hf_dict()["rope_scaling"] == scaling and CausalLMConfig.from_hf_dict(c.to_hf_dict()) == c
    tiny = CausalLMConfig(family="llama", rope=dict(type="linear", theta=100.0, factor=2.0))  # model.tiny's form
    assert tiny.rope_theta == 100.0 and tiny.rope.factor == 2.0


@pytest.mark.parametrize("fields,msg", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096), "sliding_window is 4096"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "sliding_window is 'missing"),
    (dict(attention_bias=True), "attention_bias true is not supported for LlamaForCausalLM"),
    (dict(mlp_bias=True), "mlp_bias true"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "use_sliding_window true"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_scaling: rope_type 'dynamic' is not supported"),
    (dict(architectures=["GemmaForCausalLM"], model_type="gemma"), "unsupported architecture.*MistralForCausalLM"),
])
def test_refused_configs_name_the_field(fields, msg):
    with pytest.raises(ValueError, match=msg):
        CausalLMConfig.from_hf_dict(_published(**fields), source="x/config.json")


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_memory_model_counts_what_the_layer_keeps(family):
    """rlcu.memory's per-token activations of a layer (`layer_acts`) are the bytes of the distinct
    tensors `layer_fwd(keep="all")` keeps beside its input, for each family's layer."""
    from rlcu.memory.parts import layer_acts

    cfg = CausalLMConfig(family=family, vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    m = rlcu.CausalLM.from_config(cfg)
    N = 7
    x = torch.randn(N, 48)
    cu = torch.tensor([0, N], dtype=torch.int32)
    _, kept = m._layer_fwd(0, x, torch.arange(N, dtype=torch.int32), cu, N, "all")
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for k, t in kept.items() if t is not None and k != "x"}
    assert sum(storages.values()) == N * layer_acts(cfg, 4)
