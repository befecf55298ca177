"""Captured training steps on CUDA against the same steps run eagerly: the same kernels on the
same buffers, so the losses, the optimizer's metrics and every buffer after the update (bf16
weights, fp32 master, moments) are expected bit for bit."""

import pytest
import torch
from support.trainers import SFT_TINY, V, sft_config, token_rows

import rlcu
from rlcu.config import OptimConfig
from rlcu.optim import FlatAdamW
from rlcu.train.critic import Critic
from rlcu.train.static_batch import pack, slot_bucket
from rlcu.train.step_graph import StepGraph

pytestmark = pytest.mark.gpu

BUDGET = 64


def _batch(lens, seed, critic=False):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    tokens = torch.randint(0, V, (n,), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    dlp = (1.0 if critic else -1.0) * torch.rand(n, generator=g) / n  # a critic: the value loss's weights
    p = pack(tokens, cu, dlp, BUDGET, slot_bucket(len(lens), BUDGET))
    if critic:
        slots = slot_bucket(len(lens), BUDGET)
        p["v_old"] = pack(tokens, cu, torch.randn(n, generator=g), BUDGET, slots)["weights"]
        p["returns"] = pack(tokens, cu, torch.randn(n, generator=g), BUDGET, slots)["weights"]
    return p


def _steps(critic=False):
    # micro-batches of 1, 3 and 2 sequences (three slot buckets), padded; a full one
    return [[_batch([20, 17, 9], 1, critic), _batch([30, 31], 2, critic)],
            [_batch([64], 3, critic)],
            [_batch([5], 4, critic), _batch([12, 12, 12, 12, 12], 5, critic)]]


def _make(critic: bool, graphs: bool, ckpt):
    m = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**SFT_TINY), device="cuda", dtype=torch.bfloat16, seed=0)
    m.gradient_checkpointing = ckpt
    if critic:
        m = Critic.from_trunk(m, head_init_std=0.1)
    opt = FlatAdamW(m, OptimConfig(lr=1e-3, max_grad_norm=0.05, weight_decay=0.01))
    return m, opt, StepGraph(m, opt, budget=BUDGET, max_seqlen=BUDGET, graphs=graphs)


def _state(m, opt):
    return {"flat": m.flat.clone(), "master": opt.master.clone(), "m": opt.m.clone(), "v": opt.v.clone()}


@pytest.mark.parametrize("critic", [False, True], ids=["lm", "critic"])
@pytest.mark.parametrize("ckpt", [True, "attention"])
def test_graphed_steps_are_the_eager_steps(critic, ckpt):
    runs = {}
    for graphs in (False, True):
        m, opt, sg = _make(critic, graphs, ckpt)
        out = [sg.step(p, 1e-3 * (i + 1)) for i, p in enumerate(_steps(critic))]
        runs[graphs] = (out, _state(m, opt), opt.step_count, sg.captures)
    (eo, es, ec, _), (go, gs, gc, captures) = runs[False], runs[True]
    assert captures == 5  # slot buckets 4, 2, 1, 8 and the update
    assert ec == gc == 3
    for (le, ie), (lg, ig) in zip(eo, go):
        assert le == lg, (le, lg)
        assert ie == ig
    assert any(i["clip_scale"] < 1.0 for _, i in go)  # clipping happened on the device
    for k in es:
        assert torch.equal(es[k], gs[k]), k


@pytest.mark.parametrize("ckpt", [True, False])
def test_graphed_lora_steps_are_the_eager_steps(ckpt):
    """Adapters with dropout on the frozen bf16 base: the captured steps replay with a fresh seed
    each micro-batch (written into the graph's seed tensor) and give the eager steps' bits: the
    adapters, their master and moments; the base untouched; the seeds' count the same."""
    from support.lora_util import random_adapter

    from rlcu.model.lora import LoraConfig

    runs = {}
    for graphs in (False, True):
        m = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**SFT_TINY), device="cuda", dtype=torch.bfloat16, seed=0)
        m.gradient_checkpointing = ckpt
        base = m.flat.clone()
        ad = random_adapter(m, LoraConfig(r=4, alpha=8, dropout=0.1, target_modules="all-linear"))
        opt = FlatAdamW(ad, OptimConfig(lr=1e-3, max_grad_norm=0.05))
        sg = StepGraph(m, opt, budget=BUDGET, max_seqlen=BUDGET, graphs=graphs)
        out = [sg.step(p, 1e-3 * (i + 1)) for i, p in enumerate(_steps())]
        assert torch.equal(m.flat, base) and m.grad_flat is None
        runs[graphs] = (out, _state(ad, opt), ad._forwards, sg.captures)
    (eo, es, en, _), (go, gs, gn, captures) = runs[False], runs[True]
    assert captures == 5 and en == gn == 5
    assert eo == go
    for k in es:
        assert torch.equal(es[k], gs[k]), k


def test_nonfinite_step_is_skipped_on_the_device():
    m, opt, sg = _make(False, True, True)
    sg.step(_steps()[1], 1e-3)
    before = _state(m, opt)
    bad = _batch([20, 17, 9], 1)
    bad["weights"][3] = float("nan")
    loss, info = sg.step([bad], 1e-3)
    assert info["skipped"] == 1 and info["nonfinite_in_row"] == 1 and opt.step_count == 1
    after = _state(m, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)
    loss, info = sg.step(_steps()[1], 1e-3)  # the same graphs go on
    assert info["skipped"] == 0 and opt.step_count == 2 and sg.captures == 3


def test_recaptures_when_the_gradients_move():
    """release_grads between steps (as the RL trainers do), twice: freed, the block comes back at
    the same address with the next step's zero_grad (nothing took it in between), so the graphs'
    pointers are the live buffer's and nothing is captured again; held elsewhere (`old`), the
    new buffer lands at another address and everything is captured again. Either way each step
    is the eager one, bit for bit."""
    runs = {}
    for graphs in (False, True):
        m, opt, sg = _make(False, graphs, True)
        out, same = [sg.step(_steps()[1], 1e-3)], []
        for hold in (False, True):
            ptr, old = m.grad_flat.data_ptr(), m.grad_flat
            if not hold:
                del old
            m.release_grads()
            out.append(sg.step(_steps()[1], 1e-3))
            same.append(m.grad_flat.data_ptr() == ptr)
        runs[graphs] = out, _state(m, opt), same, sg.captures
    (eo, es, _, _), (go, gs, same, captures) = runs[False], runs[True]
    assert same[1] is False  # held: another address
    assert captures == 2 * (1 + (not same[0]) + 1)  # micro + update, at the start and after each move
    assert eo == go
    for k in es:
        assert torch.equal(es[k], gs[k]), k


def test_sft_with_cuda_graph(tmp_path):
    from rlcu.train.sft import SFTTrainer

    rows = token_rows(16)
    res = {}
    for on in (False, True):
        m = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**SFT_TINY), device="cuda", dtype=torch.bfloat16, seed=0)
        tr = SFTTrainer(sft_config(tmp_path / str(on), "steps=3", "batch_tokens=48", "grad_accum=2",
                                   "model.device=cuda", f"cuda_graph={on}"), rows, model=m)
        assert (tr.step_graph is not None) == on
        res[on] = tr.train()
    # the head runs over other rows (all of them, shifted), so the sums round differently
    assert abs(res[True]["loss"] - res[False]["loss"]) < 2e-2 * abs(res[False]["loss"])
    assert res[True]["skipped"] == 0
