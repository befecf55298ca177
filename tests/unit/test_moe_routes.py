"""Routing replay (model/routes.py, ops/moe_route.py route_replay): the weights of given experts
from the router's own logits, kernel and twin against float64 autograd; a tiny Qwen3-MoE whose
forward replays chosen experts against transformers' with its router patched to the same choice
(logprobs and every gradient, the routers' included); replaying the model's own choice changes no
bit; the record of the trainer's own choice."""

import pytest
import torch
from support.hf_util import make_moe_model, rel_err
from support.interp_util import kernels_runnable

import rlcu
from rlcu.model.routes import Routes, route_dtype
from rlcu.ops import moe_route

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
REPLAY = {"kernel": moe_route.route_replay_triton, "twin": moe_route.route_replay_ref}


def _choice(T, E, k, seed):
    """k distinct experts a row, not the top-k: each row a random permutation's head."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
@pytest.mark.parametrize("norm", [True, False])
def test_route_replay_matches_float64(impl, norm):
    if impl == "kernel" and not kernels_runnable(moe_route._route_replay_kernel):
        pytest.skip("no triton, or not interpreted on the CPU")
    T, E, k = 29, 7, 3
    lg = torch.randn(T, E, generator=torch.Generator().manual_seed(0))
    ids = _choice(T, E, k, 1)
    w, p = REPLAY[impl](lg, ids, norm)
    L = lg.double().requires_grad_()
    pr = torch.softmax(L, 1)
    sel = pr.gather(1, ids.long())
    ww = sel / sel.sum(1, keepdim=True) if norm else sel
    assert rel_err(p, pr.detach()) < 1e-6 and rel_err(w, ww.detach()) < 1e-6
    own_ids, own_w, own_p = moe_route.route_fwd_ref(lg, k, norm)  # replaying the own choice: the same bits
    w2, p2 = REPLAY[impl](lg, own_ids, norm)
    if impl == "twin":
        assert torch.equal(w2, own_w) and torch.equal(p2, own_p)
    dw = torch.randn(T, k, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad((ww * dw.double()).sum(), L)[0]  # route_bwd is replay's backward too
    assert rel_err(moe_route.route_bwd(dw, p, ids, w, norm), want) < 1e-5


def _patched_router(choices):
    """transformers' router forward taking the next replayed choice (rows with -1: its own top-k)."""
    it = iter(choices)

    def forward(self, h):
        h = h.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        ids = next(it).long()
        own = torch.topk(probs, self.top_k, dim=-1).indices
        ids = torch.where(ids[:, :1] >= 0, ids, own)
        vals = probs.gather(1, ids)
        if self.norm_topk_prob:
            vals = vals / vals.sum(-1, keepdim=True)
        return logits, vals.to(logits.dtype), ids

    return forward


@pytest.mark.parametrize("ckpt", [True, False])
def test_replayed_forward_and_grads_match_hf_with_the_same_choice(tmp_path, monkeypatch, ckpt):
    hf, folder = make_moe_model(tmp_path, seed=4, num_experts=7, num_experts_per_tok=3, mlp_only_layers=[],
                                num_hidden_layers=3, norm_topk_prob=True)
    m = rlcu.from_pretrained(folder)
    m.gradient_checkpointing = ckpt
    g = torch.Generator().manual_seed(0)
    lens = [23, 9]
    seqs = [torch.randint(0, 333, (L,), generator=g) for L in lens]
    tokens, cu = torch.cat(seqs), torch.tensor([0, 23, 32], dtype=torch.int32)
    N, Ls, k = 32, len(m.cfg.sparse_layers), 3
    replay = torch.stack([_choice(N, 7, k, 10 + j) for j in range(Ls)], 1).to(torch.int16)  # [N, Ls, k]
    replay[[5, 22, 31]] = -1  # rows that route themselves (a sequence's last: no engine route)
    w = torch.randn(N, generator=g)
    r = Routes(m.cfg, N, m.device, replay)
    lp = m.forward(tokens, cu, temperature=0.9, routes=r)
    m.zero_grad()
    m.backward(w)
    choices = [replay[a:b, j] for a, b in ((0, 23), (23, 32)) for j in range(Ls)]  # HF: a sequence at a time
    monkeypatch.setattr(hf_moe.Qwen3MoeTopKRouter, "forward", _patched_router(choices))
    total, off = 0.0, 0
    for s in seqs:
        lpr = (hf(s[None]).logits[0] / 0.9).log_softmax(-1)[:-1].gather(1, s[1:, None])[:, 0]
        assert rel_err(lp[off + 1 : off + len(s)], lpr.detach()) < 1e-5
        total = total + (w[off + 1 : off + len(s)] * lpr).sum()
        off += len(s)
    hf.zero_grad()
    total.backward()
    for n, p in hf.named_parameters():
        assert rel_err(m.grads[n], p.grad) < 1e-4, n
    # the record: the router's own choice, also where replay overrode it (the first layer's input is
    # the same either way; later layers' inputs follow the replayed experts)
    own = Routes(m.cfg, N, m.device)
    m.forward(tokens, cu, routes=own, grad=False)
    assert torch.equal(own.taken[:, 0], r.taken[:, 0]) and (r.taken >= 0).all()
    assert not torch.equal(r.taken[:, 0], replay[:, 0])


def test_replaying_the_own_choice_changes_no_bit(tmp_path):
    _, folder = make_moe_model(tmp_path, seed=5, num_experts=5, num_experts_per_tok=2)
    m = rlcu.from_pretrained(folder)
    tokens = torch.randint(0, 333, (27,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 27], dtype=torch.int32)
    rec = Routes(m.cfg, 27, m.device)
    lp0 = m.forward(tokens, cu, routes=rec)
    m.zero_grad()
    m.backward(torch.ones(27))
    g0 = m.grad_flat.clone()
    lp1 = m.forward(tokens, cu, routes=Routes(m.cfg, 27, m.device, rec.taken.to(route_dtype(5))))
    m.zero_grad()
    m.backward(torch.ones(27))
    assert torch.equal(lp0, lp1) and torch.equal(g0, m.grad_flat)
    with pytest.raises(ValueError, match="replay must be"):
        Routes(m.cfg, 27, m.device, rec.taken[:3])
