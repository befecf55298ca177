"""The training step at a static token budget (train/static_batch.py, train/step_graph.py) on the
CPU: packing, the padded step against the unpadded one (loss and every gradient, the LM head and
the critic's value head), the optimizer's device-scalar kernel against the host-scalar one bit for
bit (interpreted), the fallback reasons, and the SFT switch. The capture itself: test_step_graph_gpu.py."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.hf_util import rel_err  # noqa: E402
from support.interp_util import needs_triton as needs_triton_for  # noqa: E402
from support.trainers import V, sft_config, tiny, token_rows  # noqa: E402

from rlcu.config import ConfigError, SFTConfig, load_config  # noqa: E402
from rlcu.ops import adamw as adamw_mod  # noqa: E402
from rlcu.ops.adamw import adamw_step, adamw_step_device, step_coefs  # noqa: E402
from rlcu.ops.rl_loss import value_loss  # noqa: E402
from rlcu.train.critic import Critic  # noqa: E402
from rlcu.train.static_batch import misfit, pack, slot_bucket  # noqa: E402
from rlcu.train.step_graph import StepGraph, why_not  # noqa: E402

needs_triton = needs_triton_for(adamw_mod._adamw_kernel)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def batch(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    tokens = torch.randint(0, V, (n,), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    dlp = -torch.rand(n, generator=g)
    dlp[cu[:-1].long()] = 0.0  # a first token has no prediction
    return tokens, cu, dlp


def test_pack_fields():
    tokens, cu, dlp = batch([3, 1, 4])
    p = pack(tokens, cu, dlp, budget=11, slots=4)
    assert p["tokens"][:8].tolist() == tokens.tolist() and p["tokens"][8:].tolist() == [0] * 3
    assert p["cu"].tolist() == [0, 3, 4, 8, 8]
    assert p["pos"].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 0, 0]
    # row i scores token i + 1 of its own sequence; the last rows of sequences and padding score nothing
    live = [0, 1, 4, 5, 6]
    assert p["targets"][live].tolist() == tokens[[i + 1 for i in live]].tolist()
    assert torch.equal(p["weights"][live], dlp[[i + 1 for i in live]])
    dead = [2, 3, 7, 8, 9, 10]
    assert p["weights"][dead].tolist() == [0.0] * 6 and p["targets"][dead].tolist() == [0] * 6
    with pytest.raises(ValueError, match="does not fit"):
        pack(tokens, cu, dlp, budget=7, slots=4)


def test_slots_and_misfit():
    assert [slot_bucket(s, 64) for s in (1, 2, 3, 5, 17)] == [1, 2, 4, 8, 32]
    assert slot_bucket(50, 40) == 40
    assert misfit(10, 2, 5, budget=16, max_seqlen=8) is None
    assert "more than the graph's budget of 16" in misfit(17, 2, 5, budget=16, max_seqlen=8)
    assert "longer than the graph's max_seqlen 8" in misfit(12, 2, 9, budget=16, max_seqlen=8)


@pytest.mark.parametrize("ckpt", [True, "attention", False])
def test_padded_step_matches_the_model(ckpt):
    """Two micro-batches padded to a budget and slots: the loss (sum dlp lp) and every gradient
    are the unpadded forward/backward's."""
    m = tiny()
    m.gradient_checkpointing = ckpt
    parts = [batch([5, 9, 2], seed=1), batch([13, 4], seed=2)]
    m.zero_grad()
    want = 0.0
    for tokens, cu, dlp in parts:
        lp = m.forward(tokens, cu)
        want += float((lp * dlp).sum())
        m.backward(dlp)
    g_want = m.grad_flat.clone()
    sg = StepGraph(m, None, budget=24, max_seqlen=20, graphs=False)
    packed = [pack(t, c, d, 24, s) for (t, c, d), s in zip(parts, (8, 2))]  # 5 empty sequence slots, none
    loss, info = sg.step(packed)
    assert info == {}
    assert abs(loss - want) < 1e-5 * abs(want)
    assert rel_err(m.grad_flat, g_want) < 1e-5


def test_padded_critic_step_matches_the_critic():
    c = Critic.from_trunk(tiny(), head_init_std=0.1)
    tokens, cu, _ = batch([6, 3, 7], seed=4)
    n = tokens.numel()
    g = torch.Generator().manual_seed(5)
    v_old, ret = torch.randn(n, generator=g), torch.randn(n, generator=g)
    w = torch.rand(n, generator=g)
    w[cu[:-1].long()] = 0.0
    c.zero_grad()
    v = c.forward(tokens, cu)
    _, dv, st = value_loss(v, v_old, ret, w, clip=0.2)
    c.backward(dv)
    g_want = c.grad_flat.clone()
    p = pack(tokens, cu, w, 20, 4)
    p["v_old"], p["returns"] = pack(tokens, cu, v_old, 20, 4)["weights"], pack(tokens, cu, ret, 20, 4)["weights"]
    sg = StepGraph(c, None, budget=20, max_seqlen=16, graphs=False, value_clip=0.2)
    loss, _ = sg.step([p])
    assert abs(loss - float(st[0])) < 1e-5 * abs(float(st[0]))
    assert rel_err(c.grad_flat, g_want) < 1e-5


def test_eager_step_with_the_optimizer():
    """graphs=False with an optimizer: the static step then FlatAdamW.step (the reference the
    replayed update matches bit for bit on the GPU)."""
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW

    m = tiny()
    opt = FlatAdamW(m, OptimConfig(lr=1e-3, max_grad_norm=0.5))
    sg = StepGraph(m, opt, budget=32, max_seqlen=32, graphs=False)
    w0 = m.flat.clone()
    tokens, cu, dlp = batch([7, 8], seed=3)
    loss, info = sg.step([pack(tokens, cu, dlp, 32, 2)], 1e-3)
    assert info["skipped"] == 0 and info["clip_scale"] <= 1.0 and opt.step_count == 1
    assert not torch.equal(m.flat, w0)


def test_why_not_on_the_cpu():
    m = tiny()
    assert "need a CUDA device" in why_not(m)
    with pytest.raises(ValueError, match="cannot capture this training step: CUDA graphs need a CUDA device"):
        StepGraph(m, None, budget=16, max_seqlen=16)


@needs_triton
@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_adamw_device_scalars_bitwise(monkeypatch, state):
    """The step's scalars read from device memory give the host-scalar kernel's bits; gate 0
    writes nothing."""
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    monkeypatch.setattr(adamw_mod, "LAUNCH", {"sr": (256, 4), "plain": (256, 4)})
    n, hp = 1000, dict(beta1=0.9, beta2=0.95, eps=1e-8)
    g0 = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=g0)
    grads = [torch.randn(n, generator=g0) for _ in range(3)]
    a = [p0.clone(), torch.zeros(n, dtype=state), torch.zeros(n, dtype=state), torch.empty(n, dtype=torch.bfloat16)]
    b = [x.clone() for x in a]
    scale = torch.tensor(0.7)
    for t, g in enumerate(grads, start=1):
        lr = 1e-3 * t
        adamw_step(a[0], g, a[1], a[2], a[3], lr=lr, weight_decay=0.1, step=t, grad_scale=scale, seed=3, **hp)
        coef, key = step_coefs(lr, 0.9, 0.95, 0.1, t, seed=3)
        adamw_step_device(b[0], g, b[1], b[2], b[3], coef, key, grad_scale=scale, **hp)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.int16) if y.dtype == torch.bfloat16 else y)
    coef[3] = 0.0
    before = [x.clone() for x in b]
    adamw_step_device(b[0], grads[0], b[1], b[2], b[3], coef, key, grad_scale=scale, **hp)
    assert all(torch.equal(x, y) for x, y in zip(before, b))


@needs_triton
def test_static_step_does_not_depend_on_the_schedule(monkeypatch):
    """A replayed step runs the op-by-op step's kernels on the same buffers, but not on the same
    schedule: which of a launch's programs runs first is the GPU's choice, and differs between a
    replay and an eager launch. The whole step (interpreted: forward, tied LM head, backward,
    norm, clip, AdamW) gives the same bits with every launch's programs run in reverse order.
    It caught the embedding backward's atomic adds (dW[id] += dx[i] in whatever order the
    programs land, onto the tied head's gradient): the fp32 master and moments of a replay
    differed from the eager step's in the last bits, the bf16 weights and the loss did not."""
    from triton.runtime.interpreter import interpreter_builder as b

    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW

    monkeypatch.setenv("RLCU_BACKEND", "triton")
    lens = [70, 40, 20]  # 130 tokens of 61 ids: many repeats, over three tiles of the embedding backward
    tokens, cu, dlp = batch(lens, seed=6)
    packed = pack(tokens, cu, dlp / 130, 136, 4)

    def run():
        m = tiny()  # fp32: the interpreter's bf16 is not the GPU's
        opt = FlatAdamW(m, OptimConfig(lr=1e-3, max_grad_norm=0.05))
        out = StepGraph(m, opt, budget=136, max_seqlen=136, graphs=False).step([packed], 1e-3)
        return out, [m.grad_flat.clone(), opt.master.clone(), opt.m.clone(), opt.v.clone()]

    (loss, info), bufs = run()
    orig = b.set_grid_idx
    monkeypatch.setattr(b, "set_grid_idx", lambda x, y, z: orig(*(g - 1 - i for g, i in zip(b.grid_dim, (x, y, z)))))
    (loss_r, info_r), bufs_r = run()
    assert info["skipped"] == 0 and (loss_r, info_r) == (loss, info)
    for name, x, y in zip(("grad", "master", "m", "v"), bufs, bufs_r):
        assert torch.equal(x, y), name


def lora_tiny(dropout=0.2):
    from support.lora_util import random_adapter

    from rlcu.model.lora import LoraConfig

    m = tiny()
    random_adapter(m, LoraConfig(r=4, alpha=8, dropout=dropout, target_modules="all-linear"))
    return m


@pytest.mark.parametrize("ckpt", [True, False])
def test_padded_lora_step_matches_the_model(ckpt):
    """With adapters and dropout: the padded step's loss and the adapters' gradient are the model's
    own forward/backward's with the same seeds (the adapters' count, which the step advances as an
    eager forward does); other seeds give other masks, another gradient. The base gets none."""
    m = lora_tiny()
    m.gradient_checkpointing = ckpt
    parts = [batch([5, 9, 2], seed=1), batch([13, 4], seed=2)]
    m.zero_grad()
    want = 0.0
    for tokens, cu, dlp in parts:
        want += float((m.forward(tokens, cu) * dlp).sum())
        m.backward(dlp)
    g_want, n = m.lora.grad_flat.clone(), m.lora._forwards
    m.lora._forwards = 0
    sg = StepGraph(m, None, budget=24, max_seqlen=20, graphs=False)
    packed = [pack(t, c, d, 24, s) for (t, c, d), s in zip(parts, (8, 2))]
    loss, _ = sg.step(packed)
    assert m.lora._forwards == n == 2 and m.grad_flat is None
    assert abs(loss - want) < 1e-5 * abs(want)
    assert rel_err(m.lora.grad_flat, g_want) < 1e-5
    sg.step(packed)  # seeds 3 and 4
    assert rel_err(m.lora.grad_flat, g_want) > 1e-2


class _CpuGraphs(StepGraph):
    """StepGraph's graph path on the CPU: `_record` runs the warm-ups (the update gated off) and
    keeps the region; its replay runs the region again with the adapters' host seed draw
    forbidden, as a CUDA graph replays device work only (a seed drawn on the host inside the region
    would be frozen into the graph at capture). It records the seed each replay reads."""

    def _record(self, fn):
        self.enable.zero_()
        for _ in range(self.warmup):
            fn()
        self.enable.fill_(1.0)
        self.captures += 1
        return _Replay(self, fn)


class _Replay:
    def __init__(self, sg, fn):
        self.sg, self.fn = sg, fn

    def replay(self):
        ad = self.sg.lora
        if self.fn != self.sg._update:  # a micro-batch's region: the seed its forward reads
            self.sg.seeds.append(int(self.sg.lora_seed))

        def drawn_on_the_host():
            raise AssertionError("a host seed drawn inside a captured region")
        ad.next_seed = drawn_on_the_host
        try:
            self.fn()
        finally:
            del ad.next_seed


@needs_triton
def test_graphed_lora_step_equals_the_eager_one(monkeypatch):
    """A LoRA step (dropout on) through the graph path -- capture's warm-ups, every region replayed
    from static buffers, the device-scalar AdamW, the gate -- against the eager step (the model's
    forward and backward, FlatAdamW.step), two steps of two micro-batches: the adapters, the
    optimizer's master and moments and the seeds' count bit for bit, every replay reading a fresh
    seed that the host wrote, the eager forwards' seeds."""
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW

    monkeypatch.setenv("RLCU_BACKEND", "triton")
    parts = [batch([5, 9, 2], seed=1), batch([13, 4], seed=2)]
    packed = [pack(t, c, d / 33, 32, s) for (t, c, d), s in zip(parts, (4, 2))]

    def run(cls):
        m = lora_tiny()
        opt = FlatAdamW(m.lora, OptimConfig(lr=1e-2, max_grad_norm=0.05))
        sg = cls(m, opt, budget=32, max_seqlen=32, graphs=False)
        sg.graphs, sg.seeds = cls is _CpuGraphs, []
        out = [sg.step(packed, lr) for lr in (1e-2, 5e-3)]
        return out, sg, [m.lora.flat.clone(), opt.master.clone(), opt.m.clone(), opt.v.clone()], m.lora._forwards

    out_e, _, bufs_e, n_e = run(StepGraph)
    out_g, sg, bufs_g, n_g = run(_CpuGraphs)
    assert sg.captures == 3 and out_e[0][1]["skipped"] == 0 and out_e[0][1]["clip_scale"] < 1
    assert out_g == out_e and n_g == n_e == 4
    seeds = [(0 * 1_000_003 + k) % (1 << 62) for k in (1, 2, 3, 4)]  # LoraConfig.seed 0, forwards 1..4
    assert sg.seeds == seeds
    for name, x, y in zip(("adapters", "master", "m", "v"), bufs_e, bufs_g):
        assert torch.equal(x, y), name


def test_config_switch(tmp_path):
    assert SFTConfig().cuda_graph is False
    assert load_config(SFTConfig, None, ["cuda_graph=yes"]).cuda_graph is True
    with pytest.raises(ConfigError, match="cuda_graph must be true or false"):
        load_config(SFTConfig, None, ["cuda_graph=maybe"])


def test_sft_falls_back_on_the_cpu(tmp_path):
    from rlcu.train.sft import SFTTrainer

    rows = token_rows(8)
    res = {}
    for on in (False, True):
        tr = SFTTrainer(sft_config(tmp_path / str(on), "steps=2", "batch_tokens=40", f"cuda_graph={on}"), rows,
                        model=tiny())
        assert tr.step_graph is None
        assert any("cuda_graph: eager steps (CUDA graphs need a CUDA device" in n for n in tr._notes) == on
        res[on] = tr.train()
    assert res[True]["loss"] == res[False]["loss"]
