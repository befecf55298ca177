"""The optimizer's memory modes (optim.master_weights: false, optim.state_dtype: bfloat16) and
the gradient buffer's release between RL steps: the AdamW kernel against its twin bit for bit
(the stochastic-rounding bits included), stochastic rounding unbiased where round-to-nearest
is not, bf16 state tracking the fp32 reference, release_grads, the config errors, and GRPO's
resume equivalence with bf16 weights and bf16 moments on the CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.hf_util import rel_err  # noqa: E402
from support.interp_util import needs_triton as needs_triton_for  # noqa: E402
from support.trainers import TINY, first_is_even, grpo_trainer, no_timing  # noqa: E402

from rlcu.config import ConfigError, OptimConfig, _build  # noqa: E402
from rlcu.ops import adamw as adamw_mod  # noqa: E402
from rlcu.ops.adamw import adamw_step, adamw_step_ref, rounding_bits_ref, rounding_key, sround_bf16_ref  # noqa: E402
from rlcu.optim import FlatAdamW  # noqa: E402

needs_triton = needs_triton_for(adamw_mod._adamw_kernel)

HP = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
F32, BF16 = torch.float32, torch.bfloat16


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _state(n, p_dtype, s_dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, generator=g) * 0.05).to(device, p_dtype)
    return p, torch.zeros(n, device=device, dtype=s_dtype), torch.zeros(n, device=device, dtype=s_dtype)


def _grads(n, steps, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * (3 if i % 2 else 0.01)).to(device) for i in range(steps)]


# ---------------------------------------------------------------- kernel == twin, bit for bit
@needs_triton
@pytest.mark.parametrize("p_dtype, s_dtype", [(BF16, BF16), (BF16, F32), (F32, BF16), (F32, F32)])
@pytest.mark.parametrize("scale_kind, g_dtype", [("float", F32), ("tensor", BF16)])
def test_kernel_equals_twin_bit_for_bit(monkeypatch, p_dtype, s_dtype, scale_kind, g_dtype):
    monkeypatch.setattr(adamw_mod, "LAUNCH", {"sr": (256, 4), "plain": (256, 4)})
    monkeypatch.setattr(adamw_mod, "REF_CHUNK", 384)  # the twin's chunks cut across the kernel's blocks
    n = 1000
    p, m, v = _state(n, p_dtype, s_dtype)
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    with_out = p_dtype == F32
    out = torch.empty(n, dtype=BF16) if with_out else None
    out_r = torch.empty(n, dtype=BF16) if with_out else None
    for t, g in enumerate(_grads(n, 4), start=1):
        g = g.to(g_dtype)
        s = 0.37 * t
        monkeypatch.setenv("RLCU_BACKEND", "triton")
        adamw_step(p, g, m, v, out, step=t, grad_scale=torch.tensor(s) if scale_kind == "tensor" else s, seed=11,
                   **HP)
        monkeypatch.setenv("RLCU_BACKEND", "torch")
        adamw_step(pr, g, mr, vr, out_r, step=t, grad_scale=s, seed=11, **HP)
        assert torch.equal(p, pr) and torch.equal(m, mr) and torch.equal(v, vr), t
    assert p.dtype == p_dtype and m.dtype == v.dtype == s_dtype
    assert (v.float() >= 0).all()


@needs_triton
@pytest.mark.parametrize("base", [(1 << 32) - 300, (5 << 32) - 256, 7 << 32])
def test_kernel_rounds_as_the_twin_across_a_2_32_boundary(monkeypatch, base):
    """The kernel hashes k = H(key ^ hi) once or twice a program; a block whose indices cross
    a multiple of 2^32 (a shard far into a large buffer) takes each element's own hi."""
    monkeypatch.setattr(adamw_mod, "LAUNCH", {"sr": (256, 4), "plain": (256, 4)})
    n = 1000
    p, m, v = _state(n, BF16, BF16)
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    for t, g in enumerate(_grads(n, 2), start=1):
        monkeypatch.setenv("RLCU_BACKEND", "triton")
        adamw_step(p, g, m, v, None, step=t, grad_scale=1.0, seed=3, index_base=base, **HP)
        monkeypatch.setenv("RLCU_BACKEND", "torch")
        adamw_step(pr, g, mr, vr, None, step=t, grad_scale=1.0, seed=3, index_base=base, **HP)
        assert torch.equal(p, pr) and torch.equal(m, mr) and torch.equal(v, vr), t


def test_rounding_bits_are_the_documented_hash():
    """The twin's bits, element by element, from the formula in plain Python integers, at
    indices past 2^32 too (the kernel's int64 offsets: hi ^ key, then lo)."""
    from rlcu.ops.adamw import _py_hash32

    key = rounding_key(5, 17)
    for start in (0, (1 << 32) - 2, (3 << 32) + 7):
        r = rounding_bits_ref(key, start, 4).tolist()
        for j, rj in enumerate(r):
            i = start + j
            k = _py_hash32((i >> 32) ^ key)
            assert rj == _py_hash32((_py_hash32((i & 0xFFFFFFFF) ^ k) + k) & 0xFFFFFFFF)
    assert rounding_key(5, 17) != rounding_key(5, 18) != rounding_key(6, 17)
    assert rounding_key(0, 1) == rounding_key(0, 1) < 1 << 32


# ---------------------------------------------------------------- stochastic rounding
def test_sround_is_unbiased_and_picks_a_neighbour():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, generator=g) * torch.logspace(-30, 30, 48)  # any binade
    K = 4096
    r16 = torch.randint(0, 1 << 16, (K, 48), generator=g)
    y = sround_bf16_ref(x.expand(K, 48), r16).float()  # [K, 48]
    ulp = (x.abs() * 2**-7).clamp_min(1e-38)
    assert ((y - x).abs() <= ulp).all()
    assert (y.unique(dim=0).shape[0]) > 1  # it does round both ways
    err = (y.mean(0) - x).abs() / ulp
    assert err.max() < 0.04, err.max()  # E[y] = x: ~0.008 ulp std of the mean at K = 4096
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0**127, 2.0**-133, float("inf"), float("-inf")])
    assert torch.equal(sround_bf16_ref(exact, torch.full((8,), 0xFFFF)).float(), exact)
    assert torch.isnan(sround_bf16_ref(torch.tensor([float("nan")]), torch.tensor([0xFFFF]))).all()


class Flat:
    """The optimizer's view of a model: .flat, .grad_flat, .layout."""

    def __init__(self, n=333, dtype=F32, seed=0, scale=0.05):
        g = torch.Generator().manual_seed(seed)
        self.flat = (torch.randn(n, generator=g) * scale).to(dtype)
        self.grad_flat = torch.zeros(n)
        self.layout = None


def _run(dtype, lr, steps=8, n=4099, **optim):
    m = Flat(n, dtype)
    p0 = m.flat.float().clone()
    opt = FlatAdamW(m, OptimConfig(lr=lr, betas=(0.9, 0.999), max_grad_norm=0, **optim))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        m.grad_flat.copy_(torch.randn(n, generator=g) * 0.1 + 0.05)  # a drift every element shares
        opt.step(lr)
    return m.flat.float() - p0, opt


def test_small_updates_survive_in_bf16_weights():
    """lr 1e-4 on weights ~0.05: each update is ~half a bf16 ulp. Round-to-nearest (torch's
    AdamW on bf16 parameters) loses a large part of them; stochastic rounding keeps them
    in expectation (mean update over the elements ~ the fp32 reference's)."""
    lr, n = 1e-4, 4099
    ref, _ = _run(F32, lr)
    ours, opt = _run(BF16, lr, master_weights=False, state_dtype="bfloat16")
    assert opt.master is opt.model.flat and opt.m.dtype == BF16
    q = Flat(n, F32).flat.to(BF16).requires_grad_(True)
    q0 = q.detach().float().clone()
    topt = torch.optim.AdamW([q], lr=lr, betas=(0.9, 0.999), weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        q.grad = (torch.randn(n, generator=g) * 0.1 + 0.05).to(BF16)
        topt.step()
    rne = q.detach().float() - q0
    scale = ref.abs().mean()
    bias_ours = float((ours - ref).mean() / scale)
    bias_rne = float((rne - ref).mean() / scale)
    assert abs(bias_ours) < 0.03, bias_ours
    assert abs(bias_rne) > 0.2, bias_rne


@pytest.mark.parametrize("mode", ["bf16_state", "no_master", "both"])
def test_bf16_state_tracks_fp32_reference(mode):
    lr = 1e-2
    ref, _ = _run(F32, lr)
    kw = {"bf16_state": dict(state_dtype="bfloat16"), "no_master": dict(master_weights=False),
          "both": dict(master_weights=False, state_dtype="bfloat16")}[mode]
    dtype = F32 if mode == "bf16_state" else BF16
    ours, opt = _run(dtype, lr, **kw)
    assert rel_err(ours, ref) < (5e-3 if mode == "bf16_state" else 3e-2)
    sd = opt.state_dict()
    assert "master" not in sd and sd["m"].dtype == opt.m.dtype
    want = {"bf16_state": (0, 2 * 4099), "no_master": (0, 4 * 4099), "both": (0, 2 * 4099)}[mode]
    b = opt.state_bytes()
    assert (b["master"], b["m"]) == want


def test_no_master_state_round_trip_is_exact():
    """A run resumed from state_dict (bf16 weights as saved + bf16 m, v + step) takes the
    same next steps, rounding bits included."""
    lr, n = 1e-3, 513
    a = Flat(n, BF16)
    oa = FlatAdamW(a, OptimConfig(lr=lr, master_weights=False, state_dtype="bfloat16", rounding_seed=3))
    grads = _grads(n, 6)
    for g in grads[:3]:
        a.grad_flat.copy_(g)
        oa.step(lr)
    b = Flat(n, BF16, seed=9)
    b.flat.copy_(a.flat)  # the checkpoint's model folder
    ob = FlatAdamW(b, OptimConfig(lr=lr, master_weights=False, state_dtype="bfloat16", rounding_seed=3))
    ob.load_state_dict(oa.state_dict())
    for g in grads[3:]:
        for x, o in ((a, oa), (b, ob)):
            x.grad_flat.copy_(g)
            o.step(lr)
    assert torch.equal(a.flat, b.flat) and torch.equal(oa.m, ob.m) and torch.equal(oa.v, ob.v)
    c = Flat(n, BF16)
    oc = FlatAdamW(c, OptimConfig(lr=lr, master_weights=False, state_dtype="bfloat16", rounding_seed=4))
    for g in grads:
        c.grad_flat.copy_(g)
        oc.step(lr)
    assert not torch.equal(c.flat, a.flat)  # the seed matters


# ---------------------------------------------------------------- config
def test_config_errors_name_the_field():
    from rlcu.config import GRPOConfig, PPOConfig

    with pytest.raises(ConfigError, match=r"optim\.state_dtype must be one of 'float32', 'bfloat16'"):
        _build(GRPOConfig, {"optim": {"state_dtype": "float8"}})
    with pytest.raises(ConfigError, match=r"optim\.master_weights must be true or false"):
        _build(GRPOConfig, {"optim": {"master_weights": "maybe"}})
    with pytest.raises(ConfigError, match=r"critic\.optim\.rounding_seed must be >= 0"):
        _build(PPOConfig, {"critic": {"optim": {"rounding_seed": -1}}})
    with pytest.raises(ConfigError, match=r"optim\.release_grads must be true or false"):
        _build(GRPOConfig, {"optim": {"release_grads": 3}})
    c = OptimConfig()
    assert c.master_weights and c.state_dtype == "float32" and c.release_grads and c.rounding_seed == 0
    with pytest.raises(ValueError, match="optim.master_weights: false needs bfloat16"):
        FlatAdamW(Flat(dtype=torch.float16), OptimConfig(master_weights=False))
    o = FlatAdamW(Flat(dtype=torch.float16), OptimConfig())  # fp16 keeps its fp32 master as before
    assert o.master.dtype == F32
    p, m, v = _state(8, BF16, F32)
    with pytest.raises(ValueError, match="p_out"):
        adamw_step(p, torch.zeros(8), m, v, torch.zeros(8, dtype=BF16), step=1, grad_scale=1.0, **HP)
    with pytest.raises(ValueError, match="both fp32 or both bf16"):
        adamw_step(p, torch.zeros(8), m, v.to(BF16), None, step=1, grad_scale=1.0, **HP)


def test_example_configs_document_the_fields():
    from pathlib import Path

    ex = Path(__file__).resolve().parents[2] / "examples"
    for name in ("grpo.yaml", "ppo.yaml"):
        text = (ex / name).read_text()
        for field in ("master_weights", "state_dtype", "grad_dtype", "release_grads"):
            assert field in text, (name, field)


# ---------------------------------------------------------------- the gradient buffer
def _tiny_model(dtype=F32, device="cpu"):
    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config

    cfg = Qwen3Config(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=1)
    return Qwen3.from_config(cfg, device=device, dtype=dtype, seed=2)


def test_release_grads_then_backward():
    m = _tiny_model()
    tokens = torch.randint(0, 67, (21,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    dlp = torch.randn(21, generator=torch.Generator().manual_seed(1))
    m.zero_grad()
    m.forward(tokens, cu)
    m.backward(dlp)
    g1 = m.grad_flat.clone()
    assert g1.abs().sum() > 0
    m.release_grads()
    assert m.grad_flat is None and m.grads == {} and m._g == {}
    m.forward(tokens, cu)
    m.backward(dlp)  # no zero_grad: the new buffer starts at zero
    assert torch.equal(m.grad_flat, g1)
    assert m.grads["model.embed_tokens.weight"].data_ptr() >= m.grad_flat.data_ptr()
    m.release_grads()
    m.zero_grad()
    assert m.grad_flat.abs().sum() == 0 and len(m.grads) == len(m.params)


def test_critic_release_grads_rewires_the_trunk():
    from rlcu.train.critic import Critic

    c = Critic.from_trunk(_tiny_model(), head_init_std=0.1, seed=0)
    tokens = torch.randint(0, 67, (15,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 15], dtype=torch.int32)
    dv = torch.randn(15, generator=torch.Generator().manual_seed(1))
    c.zero_grad()
    c.forward(tokens, cu)
    c.backward(dv)
    g1 = c.grad_flat.clone()
    c.release_grads()
    assert c.grad_flat is None and c.trunk.grad_flat is None
    c.forward(tokens, cu)
    c.backward(dv)
    assert torch.equal(c.grad_flat, g1)
    assert c.trunk.grad_flat.data_ptr() == c.grad_flat.data_ptr()  # the trunk's grads are the critic's


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_gradient_buffer_tracks_fp32(device):
    """optim.grad_dtype: bfloat16 on a bf16 model: FlatAdamW switches the model's buffer to bf16
    (releasing an fp32 one), the gradients of two accumulated micro-batches match the fp32
    buffer's to bf16 precision, and an fp32 model keeps fp32 gradients whatever the option.
    On the GPU: cuBLAS accumulating into bf16, the Triton embedding scatter into fp32 scratch."""
    m = _tiny_model(BF16, device)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 67, (n,), generator=g).to(device), torch.tensor(cu, dtype=torch.int32, device=device),
                torch.randn(n, generator=g).to(device)) for n, cu in ((21, [0, 9, 21]), (17, [0, 17]))]
    batches[1][0][:8] = 5  # a token repeated within and across micro-batches (embedding rows)

    def grads():
        m.release_grads()
        for tokens, cu, dlp in batches:
            m.forward(tokens, cu)
            m.backward(dlp)
        return m.grad_flat.clone()

    ref = grads()
    assert ref.dtype == F32
    FlatAdamW(m, OptimConfig(grad_dtype="bfloat16"))
    assert m.grad_dtype == BF16 and m.grad_flat is None  # the fp32 buffer was released
    got = grads()
    assert got.dtype == BF16 and got.numel() == ref.numel()
    assert rel_err(got.float(), ref) < 1e-2
    ref_views = m.layout.hf_views(ref)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        assert rel_err(m.grads[name].float(), ref_views[name]) < 1e-2, name
    f32 = _tiny_model(F32)
    FlatAdamW(f32, OptimConfig(grad_dtype="bfloat16"))
    assert f32.grad_dtype == F32


def test_bf16_embedding_backward_sums_repeats_in_fp32():
    """A bf16 dW gets each distinct id's rows summed in fp32, then one rounding: 512 equal
    small rows onto a large one, where adding them one by one in bf16 would lose them all."""
    from rlcu.ops import embedding as emb

    dW = torch.full((4, 8), 256.0, dtype=BF16)
    ids = torch.cat([torch.full((512,), 2), torch.tensor([0])])
    dx = torch.full((513, 8), 0.5, dtype=BF16)
    emb.embedding_bwd(dx, ids, dW)
    assert torch.equal(dW[2], torch.full((8,), 512.0, dtype=BF16))  # 256 + 512 * 0.5
    assert torch.equal(dW[0], torch.full((8,), 256.0, dtype=BF16))  # 256.5 rounds to 256 once
    assert torch.equal(dW[1], torch.full((8,), 256.0, dtype=BF16)) and torch.equal(dW[3], dW[1])


# ---------------------------------------------------------------- GRPO on the CPU, bf16 everywhere
def test_grpo_resume_is_bit_exact_with_bf16_weights_and_moments(tmp_path):
    """4 steps == 2 steps + resume + 2 steps with a bf16 model, no master, bf16 moments (mu=2,
    a KL reference, micro-batching): metrics, weights and moments bit for bit; and the
    gradient buffer is gone between steps."""
    kw = dict(rewards=[first_is_even], steps=4, mu=2, kl_coef=0.05, micro_batch_tokens=40,
              model=dict(dtype="bfloat16"), optim=dict(lr=1e-2, master_weights=False, state_dtype="bfloat16"),
              checkpoint=dict(every=2, save_at_end=True))
    a = grpo_trainer(tmp_path / "a", **kw)
    assert a.model.dtype == BF16 and a.opt.master is a.model.flat and a.opt.m.dtype == BF16
    init = a.model.flat.clone()
    ha = a.train()
    assert all(h["grad_norm"] > 0 and h["skipped"] == 0 for h in ha)
    assert (a.model.flat != init).float().mean() > 0.5
    assert a.model.grad_flat is None  # released after the last step's updates
    b = grpo_trainer(tmp_path / "b", **{**kw, "steps": 2})
    b.train()
    c = grpo_trainer(tmp_path / "b", **dict(kw, checkpoint=dict(every=2, save_at_end=True, resume="auto")))
    hc = c.train()
    assert c.step == 4 and no_timing(ha) == no_timing(hc)
    assert torch.equal(a.model.flat, c.model.flat)
    assert torch.equal(a.opt.m, c.opt.m) and torch.equal(a.opt.v, c.opt.v)


def test_release_grads_option(tmp_path):
    kept = grpo_trainer(tmp_path / "k", rewards=[first_is_even], steps=1, optim=dict(release_grads=False))
    freed = grpo_trainer(tmp_path / "f", rewards=[first_is_even], steps=1)
    hk, hf = kept.train(), freed.train()
    assert kept.model.grad_flat is not None and freed.model.grad_flat is None
    assert torch.equal(kept.model.flat, freed.model.flat)  # the same step either way
    assert hk[0]["loss"] == hf[0]["loss"]


def test_grpo_with_bf16_gradients(tmp_path):
    """The whole bf16 mode (no master, bf16 moments, bf16 gradients) trains: a step changes the
    weights, and its loss is the fp32-gradient run's (the forward is the same)."""
    kw = dict(rewards=[first_is_even], steps=1, micro_batch_tokens=40, model=dict(dtype="bfloat16"))
    opt = dict(lr=1e-2, master_weights=False, state_dtype="bfloat16")
    a = grpo_trainer(tmp_path / "a", **kw, optim=dict(opt, grad_dtype="bfloat16", release_grads=False))
    b = grpo_trainer(tmp_path / "b", **kw, optim=opt)
    init = a.model.flat.clone()
    ha, hb = a.train(), b.train()
    assert a.model.grad_flat.dtype == BF16 and ha[0]["skipped"] == 0
    assert ha[0]["loss"] == hb[0]["loss"]
    assert abs(ha[0]["grad_norm"] - hb[0]["grad_norm"]) < 1e-2 * hb[0]["grad_norm"]
    assert (a.model.flat != init).float().mean() > 0.5


# ---------------------------------------------------------------- GPU: bf16 kernel vs twin
@pytest.mark.gpu
@pytest.mark.parametrize("p_dtype, s_dtype", [(BF16, BF16), (F32, F32), (F32, BF16)])
def test_kernel_gpu_bf16_vs_twin(monkeypatch, p_dtype, s_dtype):
    """The compiled kernel (no FMA contraction, div_rn, sqrt_rn) against the twin on the same
    CUDA tensors: bit for bit, over many blocks and with a device-side clip scale."""
    n = 50_000_003
    p, m, v = _state(n, p_dtype, s_dtype, seed=4, device="cuda")
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    out = torch.empty(n, device="cuda", dtype=BF16) if p_dtype == F32 else None
    out_r = torch.empty_like(out) if out is not None else None
    for t, g in enumerate(_grads(n, 3, seed=5, device="cuda"), start=1):
        g = g.to(BF16) if t == 2 else g
        s = torch.tensor(0.5 * t, device="cuda")
        monkeypatch.setenv("RLCU_BACKEND", "triton")
        adamw_step(p, g, m, v, out, step=t, grad_scale=s, seed=7, **HP)
        monkeypatch.setenv("RLCU_BACKEND", "torch")
        adamw_step_ref(pr, g, mr, vr, out_r, step=t, grad_scale=s, seed=7, **HP)
        for name, x, y in (("p", p, pr), ("m", m, mr), ("v", v, vr), ("p_out", out, out_r)):
            if x is not None:
                bad = int((x != y).sum())
                assert bad == 0, f"step {t}: {bad} of {n} elements of {name} differ"


@pytest.mark.gpu
def test_grpo_gpu_bf16_mode_frees_grads_between_steps(tmp_path):
    """bf16 weights, no master, bf16 moments on CUDA: the steps learn something finite, the
    engine is asleep and the gradient buffer gone between steps; releasing a kept buffer gives
    back its bytes."""
    import gc
    import math

    from rlcu.data import synthetic as syn

    tok = syn.make_tokenizer()
    tiny = dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id, hidden_size=128,
                intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32)
    for release in (True, False):
        gc.collect()
        torch.cuda.empty_cache()
        tr = grpo_trainer(tmp_path / str(release), rewards=[first_is_even], steps=3,
                          model=dict(tiny=tiny, device="cuda", dtype="bfloat16"),
                          optim=dict(lr=1e-2, master_weights=False, state_dtype="bfloat16", release_grads=release))
        assert tr.opt.master is tr.model.flat and tr.opt.m.dtype == BF16 and tr.opt.state_bytes()["master"] == 0
        before = tr.model.flat.clone()
        for h in tr.train():
            for k in ("loss", "grad_norm", "ratio"):
                assert math.isfinite(h[k]), (k, h)
        assert not torch.equal(before, tr.model.flat) and tr.llm.asleep
        assert (tr.model.grad_flat is None) == release
        if not release:  # what the release gives back: the whole fp32 buffer
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            tr.model.release_grads()
            gc.collect()
            grad_bytes = tr.model.layout.numel * 4
            freed = held - torch.cuda.memory_allocated()
            assert 0 <= freed - grad_bytes < 4096, (freed, grad_bytes)  # the allocator rounds to 512 B
        del tr, before
