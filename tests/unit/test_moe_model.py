"""Qwen3-MoE as a family against transformers' Qwen3MoeForCausalLM (the autograd oracle), tiny and
random at odd shapes (5 or 7 experts, top 2 or 3, a dense layer by mlp_only_layers or
decoder_sparse_step, experts that receive no token), fp32 on the CPU: logits, packed logprobs,
every parameter's gradient (the routers' included) with the load-balancing loss and its gradient,
a checkpointed layer's recompute routed as its forward, saves transformers reloads, config forms
and refusals."""

import json

import pytest
import torch
from support.hf_util import make_moe_model, rel_err

import rlcu
from rlcu.memory.parts import params
from rlcu.model.config import CausalLMConfig
from rlcu.model.layout import ParamLayout

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

CASES = {
    "e5k2-norm-dense1": dict(),
    "e7k3-step2": dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[],
                       decoder_sparse_step=2, num_hidden_layers=4, tie_word_embeddings=True),
}


@pytest.fixture(params=list(CASES))
def pair(request, tmp_path):
    return make_moe_model(tmp_path, seed=len(request.param), **CASES[request.param])


def test_config_layout_and_logits_match_hf(pair):
    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    c = hf.config
    assert m.cfg.family == "qwen3_moe" and m.cfg.num_experts == c.num_experts
    dense = [i for i in range(c.num_hidden_layers) if m.cfg.sparse_layer(i) is False]
    assert dense == [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts")]
    assert sorted(m.params) == sorted(n for n, _ in hf.named_parameters() if not
                                      (c.tie_word_embeddings and n == "lm_head.weight"))
    assert params(m.cfg) == ParamLayout(m.cfg).numel
    ids = torch.randint(0, 333, (3, 29))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(m.logits(ids), ref) < 1e-5


def _hf_loss(hf, seqs, w, coef, temperature=0.8):
    """sum_t w_t lp_t + coef * aux over the packed sequences (HF run one sequence at a time; the
    aux loss over every sparse layer's rows of all of them, as the packed forward sees them)."""
    total, lps, router = 0.0, [], []
    off = 0
    for s in seqs:
        out = hf(s[None], output_router_logits=True)
        lp = (out.logits[0] / temperature).log_softmax(-1)[:-1].gather(1, s[1:, None])[:, 0]
        lps.append(lp)
        total = total + (w[off + 1 : off + len(s)] * lp).sum()
        router.append(out.router_logits)
        off += len(s)
    per_layer = tuple(torch.cat(ls, 0) for ls in zip(*router))
    aux = load_balancing_loss_func(per_layer, hf.config.num_experts, hf.config.num_experts_per_tok)
    return total + coef * aux, lps, aux


@pytest.mark.parametrize("ckpt", [True, "attention", False])
def test_packed_logprobs_grads_and_aux_match_hf_autograd(pair, ckpt):
    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    m.gradient_checkpointing = ckpt
    m.aux_weight = 0.3  # large, so that the aux gradient is seen in every router's gradient
    g = torch.Generator().manual_seed(0)
    lens = [23, 1, 9]
    seqs = [torch.randint(0, 333, (L,), generator=g) for L in lens]
    cu = torch.tensor([0, 23, 24, 33], dtype=torch.int32)
    tokens = torch.cat(seqs)
    w = torch.randn(tokens.numel(), generator=g)
    lp = m.forward(tokens, cu, temperature=0.8)
    m.zero_grad()
    m.backward(w)
    total, ref_lps, aux = _hf_loss(hf, seqs, w, 0.3)
    assert abs(float(m.aux_loss) - float(aux.detach())) < 1e-5 * float(aux.detach())
    for i, ref in enumerate(ref_lps):
        a, b = int(cu[i]), int(cu[i + 1])
        assert lp[a] == 0
        if b - a > 1:
            assert rel_err(lp[a + 1 : b], ref.detach()) < 1e-5
    hf.zero_grad()
    total.backward()
    for n, p in hf.named_parameters():
        if n == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        assert rel_err(m.grads[n], p.grad) < 1e-4, n


def test_aux_gradient_alone_matches_hf(pair):
    """With zero logprob weights the routers' gradient is the aux loss's alone (its coef from the
    config: router_aux_loss_coef where output_router_logits)."""
    hf, folder = pair
    d = json.loads((folder / "config.json").read_text())
    d.update(output_router_logits=True, router_aux_loss_coef=0.05)
    (folder / "config.json").write_text(json.dumps(d))
    m = rlcu.from_pretrained(folder)
    assert m.cfg.aux_coef == 0.05
    seq = torch.randint(0, 333, (31,), generator=torch.Generator().manual_seed(1))
    m.forward(seq, torch.tensor([0, 31], dtype=torch.int32))
    m.zero_grad()
    m.backward(torch.zeros(31))
    total, _, _ = _hf_loss(hf, [seq], torch.zeros(31), 0.05)
    hf.zero_grad()
    total.backward()
    routers = [p for n, p in hf.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(p.grad.norm() > 0 for p in routers)
    for n, p in hf.named_parameters():  # the aux loss reaches every weight before the last router
        if n in m.grads:
            if p.grad is None or p.grad.norm() == 0:
                assert m.grads[n].abs().max() == 0, n
            else:
                assert rel_err(m.grads[n], p.grad) < 1e-4, n


def test_unrouted_experts_get_no_gradient(tmp_path):
    """Few tokens over 7 experts at top 1: some experts receive none; their gradients are zero,
    as transformers' (which never runs them)."""
    hf, folder = make_moe_model(tmp_path, num_experts=7, num_experts_per_tok=1, mlp_only_layers=[])
    m = rlcu.from_pretrained(folder)
    seq = torch.randint(0, 333, (3,), generator=torch.Generator().manual_seed(2))
    m.forward(seq, torch.tensor([0, 3], dtype=torch.int32))
    m.zero_grad()
    m.backward(torch.ones(3))
    idle = 0
    for i in m.cfg.sparse_layers:
        gu = m.grads[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        idle += int((gu.flatten(1).abs().amax(1) == 0).sum())
    assert idle >= 7 * 3 - 3 * 3  # at most 3 tokens' experts a layer are touched


def test_recompute_routes_as_the_forward(pair, monkeypatch):
    """A checkpointed layer's recompute routes from the forward's kept logits (in exact mode the
    forward's GEMMs are the batch-invariant ones and the recompute's the default's, whose h2 may
    differ in its last bits): the same logits tensor, the same experts and weights; in the
    default mode the gradients are bit-equal with checkpointing on and off."""
    from rlcu.model import moe

    hf, folder = pair
    seq = torch.randint(0, 333, (37,), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 37], dtype=torch.int32)
    calls, route = [], moe.route_fwd
    monkeypatch.setattr(moe, "route_fwd", lambda lg, k, n: calls.append((lg, route(lg, k, n))) or calls[-1][1])
    m = rlcu.from_pretrained(folder, exact=True)
    m.forward(seq, cu)
    m.zero_grad()
    m.backward(torch.ones(37))
    S = len(m.cfg.sparse_layers)
    assert len(calls) == 2 * S
    for (lg_f, (ids_f, w_f, _)), (lg_r, (ids_r, w_r, _)) in zip(calls[:S], reversed(calls[S:])):
        assert lg_r is lg_f and torch.equal(ids_r, ids_f) and torch.equal(w_r, w_f)
    grads = []
    for ckpt in (False, True):
        m = rlcu.from_pretrained(folder)
        m.gradient_checkpointing = ckpt
        m.forward(seq, cu)
        m.zero_grad()
        m.backward(torch.ones(37))
        grads.append(m.grad_flat.clone())
    assert torch.equal(grads[0], grads[1])


def test_save_then_transformers_load(pair, tmp_path):
    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    for v in m.params.values():
        v.add_(0.01 * torch.randn_like(v))
    out = tmp_path / "saved"
    m.save_pretrained(out)
    d = json.loads((out / "config.json").read_text())
    assert d["architectures"] == ["Qwen3MoeForCausalLM"] and d["num_experts"] == hf.config.num_experts
    hf2 = type(hf).from_pretrained(out, attn_implementation="eager").float().eval()
    ids = torch.randint(0, 333, (2, 19))
    with torch.no_grad():
        ref = hf2(ids).logits
    assert rel_err(m.logits(ids), ref) < 1e-5
    assert torch.equal(rlcu.from_pretrained(out).flat, m.flat)


def test_fused_expert_tensors_load(pair, tmp_path):
    """transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj` in the file load as the
    per-expert form does."""
    from safetensors.torch import save_file

    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    out = tmp_path / "fused"
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in m.params.items()}, str(out / "model.safetensors"))
    assert torch.equal(rlcu.from_pretrained(out).flat, m.flat)


def test_config_forms_and_refusals(pair):
    hf, folder = pair
    d = json.loads((folder / "config.json").read_text())
    d["num_experts"] = d.pop("num_local_experts", d.get("num_experts"))  # the published name
    c = CausalLMConfig.from_hf_dict(d)
    assert c.num_experts == hf.config.num_experts and c.to_hf_dict()["num_experts"] == c.num_experts
    for field, val, words in (("num_experts_per_tok", 9, "num_experts_per_tok"),
                              ("mlp_only_layers", [7], "mlp_only_layers"),
                              ("hidden_act", "gelu", "hidden_act"),
                              ("use_sliding_window", True, "use_sliding_window")):
        bad = dict(d, **{field: val})
        with pytest.raises(ValueError, match=words):
            CausalLMConfig.from_hf_dict(bad)
    with pytest.raises(ValueError, match="num_experts"):
        CausalLMConfig.from_hf_dict({k: v for k, v in d.items() if k not in ("num_experts", "num_local_experts")})
    with pytest.raises(ValueError, match="num_experts must be 0"):
        CausalLMConfig(num_experts=4)


def _stored_bytes(obj, seen: dict) -> None:
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _stored_bytes(o, seen)
    elif isinstance(obj, dict):
        for o in obj.values():
            _stored_bytes(o, seen)


@pytest.mark.parametrize("keep", ["all", "inputs", "attention"])
def test_memory_model_counts_the_experts(pair, keep):
    """The memory model's flat layout holds the experts, and what a sparse and a dense layer's
    forward keeps a token is what `kept` says (the sparse layout's padding rows aside)."""
    from rlcu.memory.parts import kept
    from rlcu.ops.moe_gemm import gemm_config

    _, folder = pair
    m = rlcu.from_pretrained(folder)
    c = m.cfg
    E, Im, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    assert params(c) == m.flat.numel() > E * 3 * Im * H * len(c.sparse_layers)
    T = 61
    x = torch.randn(T, H)
    pos = torch.arange(T, dtype=torch.int32)
    cu = torch.tensor([0, T], dtype=torch.int32)
    for i in range(c.num_hidden_layers):
        _, acts = m._layer_fwd(i, x, pos, cu, T, keep)
        seen = {}
        _stored_bytes(acts, seen)
        want = T * kept(c, 4, keep, c.sparse_layer(i))
        pad = E * gemm_config("prefill")[0] * (3 * Im + H) * 4 + 4 * 2 * E if c.sparse_layer(i) and keep == "all" else 0
        aux = 2 * 4 * E if c.sparse_layer(i) else 0  # the layer's aux stats, not per token
        assert want <= sum(seen.values()) - aux <= want + pad, (i, sum(seen.values()) - aux, want)



def _aux_step(m, seqs, splits):
    """The aux loss's gradient alone (zero logprob weights) over seqs run as the micro-batches of
    `splits` (lists of indices), each weighted by its token share (train/moe_aux.py) -> (the flat
    gradient, the logged aux loss)."""
    from rlcu.train.moe_aux import AuxShare

    m.zero_grad()
    share = AuxShare(m, sum(s.numel() for s in seqs))
    for idx in splits:
        tokens = torch.cat([seqs[i] for i in idx])
        cu = torch.tensor([0, *torch.tensor([seqs[i].numel() for i in idx]).cumsum(0).tolist()], dtype=torch.int32)
        m.forward(tokens, cu)
        share.add(tokens.numel())
        share.weigh(tokens.numel())
        m.backward(torch.zeros(tokens.numel()))
    share.done()
    return m.grad_flat.clone(), share.metrics()["moe/aux_loss"]


def test_aux_loss_over_micro_batches_weighs_each_by_its_token_share(tmp_path):
    """A batch as 1 or 3 micro-batches (train/moe_aux.py): with equal loads (one sequence three
    times) the aux gradient and the logged loss are the one batch's (not 3 times); an uneven
    split's (loads differ: the documented approximation) stays of the one batch's size; the
    model's own weight is back after the step."""
    _, folder = make_moe_model(tmp_path, output_router_logits=True, router_aux_loss_coef=0.05)
    m = rlcu.from_pretrained(folder)
    g = torch.Generator().manual_seed(2)
    s = torch.randint(0, 333, (17,), generator=g)
    one, l1 = _aux_step(m, [s, s, s], [[0, 1, 2]])
    three, l3 = _aux_step(m, [s, s, s], [[0], [1], [2]])
    assert one.norm() > 0 and rel_err(three, one) < 1e-5 and l3 == pytest.approx(l1, rel=1e-6)
    assert m.aux_weight is None
    seqs = [torch.randint(0, 333, (n,), generator=g) for n in (23, 9, 14)]
    whole, _ = _aux_step(m, seqs, [[0, 1, 2]])
    split, _ = _aux_step(m, seqs, [[0], [1], [2]])
    ratio = float(split.norm() / whole.norm())
    assert 0.5 < ratio < 2, ratio  # the unweighted sum was about 3 times
