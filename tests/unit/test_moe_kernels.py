"""ops/moe_route.py, moe_sort.py, moe_gemm.py and moe.py, Qwen3-MoE's kernels: the Triton kernels
(on the CPU through TRITON_INTERPRET=1) and the twins against float64 references at odd shapes (E
not a power of two, an expert that receives no token, ties in the router, T = 1, K tails);
against transformers' Qwen3MoeSparseMoeBlock and load_balancing_loss_func (forward, aux loss and
every gradient through autograd); a token alone equals the token in a batch bit for bit; the
same inputs give the same bits; the layout's invariants."""

import pytest
import torch
from support.interp_util import kernels_runnable, needs_triton

from rlcu.ops import moe_gemm, moe_route, moe_sort
from rlcu.ops.moe import ExpertLora, aux_dprobs, aux_loss, aux_stats, experts_bwd, experts_fwd, route_bwd, route_fwd

pytestmark = pytest.mark.usefixtures("one_thread")

BF = torch.bfloat16
IMPLS = ["kernel", "twin"]
ROUTE = {"kernel": (moe_route.route_fwd_triton, moe_route.route_bwd_triton),
         "twin": (moe_route.route_fwd_ref, moe_route.route_bwd_ref)}
SORT = {"kernel": moe_sort.moe_sort_triton, "twin": moe_sort.moe_sort_ref}


def _skip_unless(impl, kernel):
    if impl == "kernel" and not kernels_runnable(kernel):
        pytest.skip("no triton, or not interpreted on the CPU")


def _backend(monkeypatch, impl):
    _skip_unless(impl, moe_gemm._grouped_mm_kernel)
    if impl == "kernel":
        monkeypatch.setenv("RLCU_BACKEND", "triton")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _logits(T, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(T, E, generator=g)
    lg[0] = 0.0  # every expert tied: the lowest ids win
    lg[:, 2] = -40.0  # expert 2 receives no token
    if T > 3:
        lg[3, [1, 4, E - 1]] = 3.0  # a tie inside the top-k
    return lg


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("norm", [True, False])
def test_route_forward_and_backward_match_float64(impl, norm):
    fwd, bwd = ROUTE[impl]
    _skip_unless(impl, moe_route._route_fwd_kernel)
    T, E, k = 29, 7, 3
    lg = _logits(T, E)
    ids, w, p = fwd(lg, k, norm)
    assert ids.dtype == torch.int32 and ids.shape == (T, k) and w.dtype == p.dtype == torch.float32
    assert ids[0].tolist() == [0, 1, 3]  # ties: the lower id first (2 is out: -40 there)
    assert sorted(ids[3].tolist()) == [1, 4, 6] and ids[3].tolist() == [1, 4, 6]
    assert not (ids == 2).any()
    L = lg.double().requires_grad_()
    pr = torch.softmax(L, 1)
    want_ids = torch.sort(pr.detach(), dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids.long(), want_ids)
    sel = pr.gather(1, want_ids)
    ww = sel / sel.sum(1, keepdim=True) if norm else sel
    assert _rel(p, pr.detach()) < 1e-6 and _rel(w, ww.detach()) < 1e-6
    g = torch.Generator().manual_seed(1)
    dw, daux = torch.randn(T, k, generator=g), torch.randn(E, generator=g)
    want = torch.autograd.grad((ww * dw.double()).sum(), L, retain_graph=True)[0]
    want_aux = torch.autograd.grad((pr * daux.double()).sum(), L)[0]
    assert _rel(bwd(dw, p, ids, w, norm, None), want) < 1e-5
    assert _rel(bwd(dw, p, ids, w, norm, daux), want + want_aux) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T,k,E,BM", [(37, 3, 7, 4), (1, 8, 13, 16), (300, 2, 5, 16)])
def test_sort_layout(impl, T, k, E, BM):
    _skip_unless(impl, moe_sort._count_kernel)
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    ids[ids == 2] = 3  # an expert without pairs
    lay = SORT[impl](ids, E, BM)
    nb = moe_sort.max_blocks(T, k, E, BM)
    assert lay.pairs.shape == (nb * BM,) and lay.block_expert.shape == (nb,)
    flat = ids.flatten().long()
    assert torch.equal(lay.counts.long(), torch.bincount(flat, minlength=E))
    for e in range(E):
        s0, s1, c = int(lay.starts[e]), int(lay.starts[e + 1]), int(lay.counts[e])
        assert s0 % BM == 0 and s1 - s0 == -(-c // BM) * BM
        seg = lay.pairs[s0:s1]
        assert torch.equal(seg[:c].long(), (flat == e).nonzero().flatten())  # by token, then slot
        assert (seg[c:] == -1).all()
        assert (lay.block_expert[s0 // BM:s1 // BM] == e).all()
    assert (lay.block_expert[int(lay.starts[E]) // BM:] == -1).all()
    assert torch.equal(lay.pairs[lay.pos.long()], torch.arange(T * k, dtype=torch.int32))
    if impl == "kernel":
        twin = moe_sort.moe_sort_ref(ids, E, BM)
        assert all(torch.equal(a, b) for a, b in zip(lay[:5], twin[:5]))


def _experts(T, H, I, E, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    wgu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    wd = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids, w, p = moe_route.route_fwd_ref(_logits(T, E, seed), k, True)
    return x, ids, w, wgu, wd


def _ref_experts(x, ids, w, wgu, wd):
    I = wd.shape[2]
    out = torch.zeros_like(x)
    for s in range(ids.shape[1]):
        e = ids[:, s].long()
        gu = torch.einsum("th,tnh->tn", x, wgu[e])
        a = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        out = out + w[:, s, None] * torch.einsum("ti,thi->th", a, wd[e])
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T,deep", [(1, False), (29, False), (29, True)])
def test_experts_forward_and_backward_match_float64(monkeypatch, impl, T, deep):
    """deep: the weight gradient on its deep-K tiles (CONFIGS['dw_long'], taken past dw_long_rows
    rows an expert on average)."""
    _backend(monkeypatch, impl)
    if deep:
        monkeypatch.setitem(moe_gemm.CONFIGS, "dw_long_rows", 0)
    H, I, E, k = 72, 40, 5, 2  # H, I: K tails under every tile
    x, ids, w, wgu, wd = _experts(T, H, I, E, k)
    out, saved = experts_fwd(x, ids, w, wgu, wd)
    X, W, G, D = (t.double().requires_grad_() for t in (x, w, wgu, wd))
    r = _ref_experts(X, ids, W, G, D)
    assert _rel(out, r) < 1e-6
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    (r * dout.double()).sum().backward()
    dg, dd = torch.full_like(wgu, 0.5), torch.full_like(wd, -0.25)  # accumulated into
    dx, dw = experts_bwd(dout, x, w, wgu, wd, saved, dg, dd)
    assert _rel(dx, X.grad) < 1e-6 and _rel(dw, W.grad) < 1e-6
    assert _rel(dg - 0.5, G.grad) < 1e-6 and _rel(dd + 0.25, D.grad) < 1e-6
    unused = [e for e in range(E) if not (ids == e).any()]
    assert unused and all((dg[e] == 0.5).all() for e in unused)


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_adapters_forward_and_backward_match_float64(monkeypatch, impl):
    """Per-expert LoRA (ExpertLora: W_e + scale B_e A_e, ranks 6 and 3) on both GEMMs: the output,
    x's gradient and every A_e, B_e gradient against float64 autograd of the merged weights; the
    frozen base takes none; a keep of 0 is the base's token exactly, a keep of 1 the adapter's."""
    _backend(monkeypatch, impl)
    T, H, I, E, k, Rg, Rd = 29, 72, 40, 5, 2, 6, 3
    x, ids, w, wgu, wd = _experts(T, H, I, E, k)
    g = torch.Generator().manual_seed(4)
    ad = [torch.randn(*s, generator=g) * 0.2 for s in ((E, Rg, H), (E, 2 * I, Rg), (E, Rd, I), (E, H, Rd))]
    lo = ExpertLora(*ad, 1.5, 0.75)
    out, saved = experts_fwd(x, ids, w, wgu, wd, lora=lo)
    X, W, *A = (t.double().requires_grad_() for t in (x, w, *ad))
    r = _ref_experts(X, ids, W, wgu.double() + 1.5 * A[1] @ A[0], wd.double() + 0.75 * A[3] @ A[2])
    assert _rel(out, r) < 1e-6 and _rel(out, experts_fwd(x, ids, w, wgu, wd)[0]) > 1e-2
    dout = torch.randn(T, H, generator=g)
    (r * dout.double()).sum().backward()
    grads = ExpertLora(*(torch.zeros_like(t) for t in ad), 0.0, 0.0)
    dx, dw = experts_bwd(dout, x, w, wgu, wd, saved, None, None, grads)
    assert _rel(dx, X.grad) < 1e-6 and _rel(dw, W.grad) < 1e-6
    for got, ref in zip(grads[:4], A):
        assert _rel(got, ref.grad) < 1e-6
    keep = (torch.arange(T) % 2).float()  # odd tokens adapted
    mixed, _ = experts_fwd(x, ids, w, wgu, wd, lora=lo._replace(keep=keep))
    base, _ = experts_fwd(x, ids, w, wgu, wd)
    assert torch.equal(mixed[0::2], base[0::2]) and torch.equal(mixed[1::2], out[1::2])


@pytest.mark.parametrize("impl", IMPLS)
def test_token_alone_equals_token_in_batch(monkeypatch, impl):
    """bf16, exact mode: a token's route and output bits do not depend on the batch (alone, in a
    prefix, among tokens that crowd other experts)."""
    _backend(monkeypatch, impl)
    T, H, I, E, k = 16, 64, 24, 6, 2
    x, _, _, wgu, wd = _experts(T, H, I, E, k, seed=5, dtype=BF)
    lg = torch.randn(T, E, generator=torch.Generator().manual_seed(6)).to(BF)
    ids, w, _ = route_fwd(lg, k, True)
    out, _ = experts_fwd(x, ids, w, wgu, wd, True)
    for t in (0, 15):
        s = slice(t, t + 1)
        i1, w1, _ = route_fwd(lg[s], k, True)
        assert torch.equal(i1, ids[s]) and torch.equal(w1, w[s])
        assert torch.equal(experts_fwd(x[s], i1, w1, wgu, wd, True)[0], out[s]), t
    assert torch.equal(experts_fwd(x[:11], ids[:11], w[:11], wgu, wd, True)[0], out[:11])
    crowd = ids.clone()
    crowd[1:] = torch.tensor([0, 1], dtype=torch.int32)  # every other token on experts 0 and 1
    assert torch.equal(experts_fwd(x, crowd, w, wgu, wd, True)[0][0], out[0])


@needs_triton(moe_gemm._grouped_mm_kernel)
def test_same_inputs_same_bits(monkeypatch):
    """Run twice: the same bits; and again under other program orders (GROUP: blocks sweeping
    the column tiles in groups of 1 and 2) and other dA tiles (BN): still the same bits."""
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    x, ids, w, wgu, wd = _experts(9, 40, 24, 5, 2, seed=7, dtype=BF)
    dout = torch.randn(9, 40, generator=torch.Generator().manual_seed(8)).to(BF)
    table = moe_gemm._INTERPRET if moe_gemm.interpreting() else moe_gemm.CONFIGS
    BM, BN, BK, warps, stages, _ = table["decode"]
    runs = []
    for group, dx_bn in ((0, BN), (0, BN), (1, BN // 2), (2, 2 * BN)):
        monkeypatch.setitem(table, "decode", (BM, BN, BK, warps, stages, group))
        monkeypatch.setitem(table, "decode_dx", (BM, dx_bn, BK, warps, stages, 2 - group))
        out, saved = experts_fwd(x, ids, w, wgu, wd)
        dg, dd = torch.zeros(wgu.shape), torch.zeros(wd.shape)  # fp32 gradients of bf16 weights
        runs.append((out, *experts_bwd(dout, x, w, wgu, wd, saved, dg, dd), dg, dd))
    assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))


def test_against_transformers_sparse_moe_block():
    """The whole layer on the twins (router GEMM, route, experts, aux loss) against transformers'
    Qwen3MoeSparseMoeBlock and load_balancing_loss_func: forward, aux loss, and the gradients of
    x, the router and both expert weights through autograd (ties: none at the k-th place)."""
    qm = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    T, H, I, E, k, coef = 23, 48, 24, 6, 2, 0.03
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(0)
    block = qm.Qwen3MoeSparseMoeBlock(cfg).double()
    for prm in block.parameters():
        torch.nn.init.normal_(prm, std=0.3)
    x = torch.randn(T, H, dtype=torch.float64)
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():  # an expert no token picks
        block.gate.weight[2] = 0.0
        block.gate.weight[2, 0] = -20.0
    X = x.clone().requires_grad_()
    y = block(X[None])[0]
    logits = torch.nn.functional.linear(X, block.gate.weight)
    hf_aux = qm.load_balancing_loss_func((logits,), E, k)
    dout = torch.randn(T, H, dtype=torch.float64)
    ((y * dout).sum() + coef * hf_aux).backward()

    f = {n: prm.detach().float() for n, prm in block.named_parameters()}
    wr, wgu, wd, xf = f["gate.weight"], f["experts.gate_up_proj"], f["experts.down_proj"], x.float()
    lg = xf @ wr.T
    ids, w, p = route_fwd(lg, k, True)
    out, saved = experts_fwd(xf, ids, w, wgu, wd)
    assert _rel(out, y.detach()) < 1e-5
    C, P = aux_stats(p, saved.layout.counts)
    assert C[2] == 0 and abs(float(aux_loss(C, P, T)) - float(hf_aux.detach())) < 1e-5 * float(hf_aux.detach())
    dg, dd = torch.zeros_like(wgu), torch.zeros_like(wd)
    dx, dw = experts_bwd(dout.float(), xf, w, wgu, wd, saved, dg, dd)
    dl = route_bwd(dw, p, ids, w, True, aux_dprobs(C, T, coef))
    dx = dx + dl @ wr
    assert _rel(dx, X.grad) < 1e-5
    assert _rel(dl.T @ xf, block.gate.weight.grad) < 1e-5
    assert _rel(dg, block.experts.gate_up_proj.grad) < 1e-5 and _rel(dd, block.experts.down_proj.grad) < 1e-5


def test_checks_name_the_argument():
    x, ids, w, wgu, wd = _experts(5, 16, 8, 5, 2)
    with pytest.raises(ValueError, match="ids int32"):
        experts_fwd(x, ids.long(), w, wgu, wd)
    with pytest.raises(ValueError, match="w_down must be"):
        experts_fwd(x, ids, w, wgu, wd[:, :, :4])
    with pytest.raises(ValueError, match="weights must be fp32"):
        experts_fwd(x, ids, w.double(), wgu, wd)
    with pytest.raises(ValueError, match="1 <= k <= E"):
        route_fwd(torch.zeros(4, 3), 4, True)
    with pytest.raises(ValueError, match="daux must be"):
        route_bwd(w, torch.zeros(5, 5), ids, w, True, torch.zeros(4))
    with pytest.raises(ValueError, match="ids must be int32"):
        moe_sort.moe_sort(ids.long(), 5, 16)


def _a3b(T, seed, E=128, k=8, H=2048, I=768):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to("cuda", BF)
    lg = torch.randn(T, E, generator=g).to("cuda", BF)
    wgu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to("cuda", BF)
    wd = (torch.randn(E, H, I, generator=g) / I**0.5).to("cuda", BF)
    return x, lg, wgu, wd, k


@pytest.mark.gpu
def test_gpu_decode_tiles_give_prefill_bits():
    """On the device at Qwen3-30B-A3B's expert shape: a token's route and output in a 1-token call
    (decode's tiles) and in a 4096-token call (prefill's) are the same bits, near the float64
    reference."""
    x, lg, wgu, wd, k = _a3b(4096, 0)
    ids, w, _ = route_fwd(lg, k, True)
    assert moe_gemm.regime(4096, k, 128) == "prefill" and moe_gemm.regime(1, k, 128) == "decode"
    out, _ = experts_fwd(x, ids, w, wgu, wd)
    sub = slice(0, 64)
    assert _rel(out[sub], _ref_experts(x[sub].double(), ids[sub], w[sub].double(), wgu.double(), wd.double())) < 1e-2
    for t in (0, 1, 1000, 4095):
        s = slice(t, t + 1)
        i1, w1, _ = route_fwd(lg[s], k, True)
        assert torch.equal(i1, ids[s]) and torch.equal(w1, w[s])
        assert torch.equal(experts_fwd(x[s], i1, w1, wgu, wd)[0], out[s]), t
    for T in (7, 256, 300):
        assert torch.equal(experts_fwd(x[:T], ids[:T], w[:T], wgu, wd)[0], out[:T]), T


@pytest.mark.gpu
def test_gpu_deep_k_weight_gradient_tiles_match_float64(monkeypatch):
    """On the device at Qwen3-30B-A3B's expert shape and the train step's depth (32768 tokens, 2048
    rows an expert on average): grouped_dw on CONFIGS['dw_long'] against float64 for a few experts,
    and against the shallow tiles (CONFIGS['dw']) for all."""
    x, lg, wgu, wd, k = _a3b(32768, 2)
    ids, w, _ = route_fwd(lg, k, True)
    _, saved = experts_fwd(x, ids, w, wgu, wd)
    lay = saved.layout
    assert moe_gemm.dw_regime(lay.pairs.shape[0], 128) == "dw_long"  # the deep tiles are the ones run
    g = torch.randn(lay.pairs.shape[0], 2 * wd.shape[2], device="cuda", generator=torch.Generator("cuda")
                    .manual_seed(4)).to(BF)
    deep = moe_gemm.grouped_dw(g, x, lay, True, torch.zeros(wgu.shape, device="cuda"))
    with monkeypatch.context() as m:
        m.setitem(moe_gemm.CONFIGS, "dw_long_rows", 10**9)
        shallow = moe_gemm.grouped_dw(g, x, lay, True, torch.zeros(wgu.shape, device="cuda"))
    assert _rel(deep, shallow) < 1e-5
    for e in (0, 63, 127):
        rows = slice(int(lay.starts[e]), int(lay.starts[e + 1]))
        pairs = lay.pairs[rows].long()
        valid = pairs >= 0
        ref = g[rows][valid].double().T @ x[pairs[valid] // k].double()
        assert _rel(deep[e], ref) < 1e-5, e


@pytest.mark.gpu
def test_gpu_graph_replay_follows_new_routing():
    """route_fwd + experts_fwd captured once in a CUDA graph (no host sync), replayed after new
    router logits are written in: the eager call's bits."""
    x, lg, wgu, wd, k = _a3b(64, 1)

    def step():
        ids, w, _ = route_fwd(lg, k, True)
        return experts_fwd(x, ids, w, wgu, wd)[0]

    step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for seed in range(3):
        lg.copy_(torch.randn(lg.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", BF))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), seed
