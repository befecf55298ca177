"""Gradient checkpointing by a number of layers and its `auto` mode: the kept-activation
bytes, the bisection that fits a memory budget, the config field, and the trainers that
resolve `auto` at their first update (on the CPU: every layer checkpointed)."""

from __future__ import annotations

import math
import types

import pytest
import torch
from support.shapes import BF16, SHAPES

import rlcu
from rlcu.config import ConfigError, ModelConfig, load_config
from rlcu.data import synthetic as syn
from rlcu.memory import FRAGMENTATION, GiB, JobShape, checkpointing_name, job_memory, parts
from rlcu.memory.fit import fit_checkpointing
from rlcu.model.config import Qwen3Config
from rlcu.train import sizing

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
RL_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, max_position_embeddings=32, tie_word_embeddings=True,
               rope_theta=10000.0, bos_token_id=None)
MB = 16384  # micro-batch tokens of the 8B fits
H200_GiB = 139.0  # what an H200 offers a process (torch.cuda.mem_get_info on the device machine)


def kept_activation_bytes(cfg, T: int, ab: int, mode) -> int:
    return parts.kept_activations(JobShape(cfg, weight_bytes=ab, micro_batch_tokens=T, checkpointing=mode))


def estimate(cfg, checkpointing, **kw):
    return job_memory(JobShape(cfg, checkpointing=checkpointing, **kw))


# ---------------------------------------------------------------- the estimate
@pytest.mark.parametrize("shape", ["small", "8b"])
@pytest.mark.parametrize("T,ab", [(128, 2), (4096, 2), (100, 4)])
def test_kept_activation_bytes_interpolates_between_none_and_full(shape, T, ab):
    cfg = Qwen3Config(**(SMALL if shape == "small" else SHAPES["8b"]))
    L = cfg.num_hidden_layers
    full, none = (kept_activation_bytes(cfg, T, ab, m) for m in ("full", "none"))
    assert kept_activation_bytes(cfg, T, ab, 0) == none
    assert kept_activation_bytes(cfg, T, ab, L) == full
    assert full == L * T * cfg.hidden_size * ab  # full checkpointing keeps each layer's input
    assert none % L == 0 and none > 4 * full
    per_full, per_none = full // L, none // L
    kept = [kept_activation_bytes(cfg, T, ab, k) for k in range(L + 1)]
    assert kept == [k * per_full + (L - k) * per_none for k in range(L + 1)]
    assert all(a > b for a, b in zip(kept, kept[1:]))  # every checkpointed layer saves memory
    att = kept_activation_bytes(cfg, T, ab, "attention")
    assert full < att < none


def test_estimate_takes_a_number_of_layers():
    cfg = Qwen3Config(**SHAPES["8b"])
    est = {k: estimate(cfg, k, micro_batch_tokens=MB, **BF16) for k in (0, 7, 36, "full", "none")}
    drop = ("shape",)
    same = [f.name for f in __import__("dataclasses").fields(est[0]) if f.name not in drop]
    assert all(getattr(est[0], f) == getattr(est["none"], f) for f in same)
    assert all(getattr(est[36], f) == getattr(est["full"], f) for f in same)
    d = est[7].kept_activations - est["full"].kept_activations
    assert d == kept_activation_bytes(cfg, MB, 2, 7) - kept_activation_bytes(cfg, MB, 2, "full") > 0
    for part in ("weights", "optimizer_state", "gradients", "kv_pool", "head_work"):
        assert getattr(est[7], part) == getattr(est["full"], part), part
    assert est[0].peak > est[7].peak > est[36].peak


def test_checkpointing_name():
    assert [checkpointing_name(m) for m in (True, "full", "attention", False, "none")] == \
        ["full", "full", "attention", "none", "none"]
    for k in (0, 1, 36):
        assert checkpointing_name(k) == k and type(checkpointing_name(k)) is int


# ---------------------------------------------------------------- fitting a budget
def _need(cfg, k, **kw):
    """What fit_checkpointing holds against the budget: the peak with the allocator's fragmentation."""
    return estimate(cfg, k, **kw).peak * FRAGMENTATION


def _peaks(cfg, **kw):
    return [_need(cfg, k, **kw) for k in range(cfg.num_hidden_layers + 1)]


def _fit(budget, cfg, **kw):
    return fit_checkpointing(budget, JobShape(cfg, **kw))


def _fewest(peaks, budget):
    """The oracle: a plain scan for the fewest checkpointed layers within budget."""
    return next((k for k, p in enumerate(peaks) if p <= budget), len(peaks) - 1)


@pytest.mark.parametrize("k", [0, 1, 5, 18, 35, 36])
def test_fit_checkpointing_on_8b_bf16(k):
    cfg, kw = Qwen3Config(**SHAPES["8b"]), dict(micro_batch_tokens=MB, **BF16)
    L = cfg.num_hidden_layers
    peaks = _peaks(cfg, **kw)
    # every checkpointed layer saves memory but the last: recomputing it holds what keeping it did
    assert all(a > b for a, b in zip(peaks[:-1], peaks[1:-1])) and peaks[-2] == peaks[-1]
    budget = peaks[k]
    got = _fit(budget, cfg, **kw)
    assert type(got) is int and got == _fewest(peaks, budget)
    assert got <= k and _need(cfg, got, **kw) <= budget
    if got > 0:
        assert _need(cfg, got - 1, **kw) > budget
    if k < L:  # a byte less than k layers' peak: one more layer
        assert _fit(budget - 1, cfg, **kw) == k + 1
    if k > 0:  # halfway to the peak with one layer fewer: still k
        assert _fit((peaks[k] + peaks[k - 1]) // 2, cfg, **kw) == k


def test_fit_checkpointing_extremes_and_an_h200():
    from rlcu.memory import EngineShape

    cfg, kw = Qwen3Config(**SHAPES["8b"]), dict(micro_batch_tokens=MB, **BF16)
    L = cfg.num_hidden_layers
    assert _fit(10**15, cfg, **kw) == 0  # everything fits: keep every activation
    assert _fit(0, cfg, **kw) == L  # nothing fits: every layer, the caller's OOM to meet
    assert _fit(_need(cfg, "full", **kw) - 1, cfg, **kw) == L
    peaks = _peaks(cfg, **kw)
    h200 = int(H200_GiB * GiB)
    k = _fit(h200, cfg, **kw)
    assert 0 < k < L and k == _fewest(peaks, h200)  # neither 'none' (~148 GiB) nor 'full' fits exactly
    assert peaks[0] / GiB > H200_GiB > peaks[L] / GiB
    # the rest of the shape reaches the fit: a KV pool that needs more room than the training phase
    big_kv = dict(kw, engine=EngineShape(kv_tokens=2_000_000))
    assert _fit(h200, cfg, **big_kv) == _fewest(_peaks(cfg, **big_kv), h200) == L


# ---------------------------------------------------------------- a model's estimate and auto
def _small_model_and_opt(**optim):
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW

    m = rlcu.Qwen3.from_config(Qwen3Config(**SMALL), dtype=torch.bfloat16)
    return m, FlatAdamW(m, OptimConfig(**optim))


@pytest.mark.parametrize("mode", [dict(), dict(master_weights=False, state_dtype="bfloat16", grad_dtype="bfloat16")])
def test_the_run_shape_uses_a_number_of_layers(mode):
    m, o = _small_model_and_opt(**mode)
    L, T = m.cfg.num_hidden_layers, 64
    m.gradient_checkpointing = True
    base = job_memory(sizing.run_shape(m, o, micro_batch_tokens=T, fused_head=True))
    P = parts.params(m.cfg)
    seen = set()
    for k in range(L + 1):
        m.gradient_checkpointing = k
        e = job_memory(sizing.run_shape(m, o, micro_batch_tokens=T, fused_head=True))
        want = estimate(m.cfg, k, weight_bytes=2, micro_batch_tokens=T, master=base.master > 0,
                        state_bytes=o.m.element_size(), grad_bytes=base.gradients // P, overlap=False)
        assert e == want, k
        assert e.kept_activations - base.kept_activations == (kept_activation_bytes(m.cfg, T, 2, k)
                                                              - kept_activation_bytes(m.cfg, T, 2, "full"))
        seen.add(e.kept_activations)
    assert len(seen) == L + 1  # each number of layers keeps its own amount


def test_resolve_auto_on_the_cpu_checkpoints_every_layer():
    m, o = _small_model_and_opt()
    m.gradient_checkpointing = "auto"
    with pytest.raises(ValueError, match="resolve_auto"):
        m.forward(torch.tensor([1, 2, 3]), torch.tensor([0, 3], dtype=torch.int32))
    msg = sizing.resolve_auto(m, sizing.run_shape(m, o, micro_batch_tokens=64, fused_head=True))
    L = m.cfg.num_hidden_layers
    assert m.gradient_checkpointing == L and type(m.gradient_checkpointing) is int
    assert msg.startswith("gradient checkpointing auto") and f"all {L} layers checkpointed" in msg
    m.zero_grad()
    m.forward(torch.tensor([1, 2, 3]), torch.tensor([0, 3], dtype=torch.int32))  # a valid mode now
    assert all("h1" not in s for s in m._trunk_ctx["saved"])


def test_resolve_auto_on_a_gpu_fits_what_the_device_leaves(monkeypatch):
    """On CUDA, auto is the fewest layers whose modelled peak fits the free and reserved memory
    (the device's answers stand in here: no GPU is needed to read them)."""
    cfg = Qwen3Config(**SHAPES["8b"])
    shape = JobShape(cfg, micro_batch_tokens=MB, **BF16)
    budget = int(_need(cfg, 9, micro_batch_tokens=MB, **BF16)) + 1  # 9 layers fit, 8 do not
    monkeypatch.setattr(sizing.torch.cuda, "mem_get_info", lambda d: (budget - 5 * GiB, 141 * GiB))
    monkeypatch.setattr(sizing.torch.cuda, "memory_reserved", lambda d: 5 * GiB)
    monkeypatch.setattr(sizing.torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0, raising=False)
    model = types.SimpleNamespace(cfg=cfg, device=torch.device("cuda"), gradient_checkpointing="auto")
    msg = sizing.resolve_auto(model, shape)
    assert model.gradient_checkpointing == 9 == fit_checkpointing(budget, shape)
    peak = job_memory(shape.with_(checkpointing=9)).peak
    assert "9 of 36 layers checkpointed" in msg and f"estimated peak {peak / GiB:.1f} GiB" in msg


def test_resolve_auto_keeps_within_the_per_process_memory_fraction(monkeypatch):
    """A process capped by torch.cuda.set_per_process_memory_fraction (its allocator fails past the cap)
    gets the layers that fit the cap, not the free memory: a user's 40 GiB budget on a bigger device."""
    cfg = Qwen3Config(**SHAPES["8b"])
    shape = JobShape(cfg, micro_batch_tokens=MB, **BF16)
    cap = int(_need(cfg, 20, micro_batch_tokens=MB, **BF16)) + 1  # 20 layers fit the cap, 19 do not
    monkeypatch.setattr(sizing.torch.cuda, "mem_get_info", lambda d: (136 * GiB, 141 * GiB))
    monkeypatch.setattr(sizing.torch.cuda, "memory_reserved", lambda d: 5 * GiB)
    monkeypatch.setattr(sizing.torch.cuda, "get_per_process_memory_fraction", lambda d: cap / (141 * GiB),
                        raising=False)
    k, budget = sizing.auto_layers(shape, torch.device("cuda"))
    assert k == 20 == fit_checkpointing(cap, shape) and abs(budget - cap) <= 1
    assert fit_checkpointing(141 * GiB, shape) < 20  # without the cap, fewer layers would be checkpointed


# ---------------------------------------------------------------- the config field
@pytest.mark.parametrize("value,want", [(True, True), (False, False), ("false", False), ("true", True), (3, 3),
                                        ("3", 3), (0, 0), (1, 1), ("attention", "attention"), ("auto", "auto"),
                                        ("none", "none"), ("full", "full")])
def test_config_gradient_checkpointing_values(value, want):
    got = ModelConfig(tiny={}, gradient_checkpointing=value).gradient_checkpointing
    assert got == want and type(got) is type(want)  # 1 stays a number of layers, not True


@pytest.mark.parametrize("value", ["bogus", -1, "-1", "Full"])
def test_config_gradient_checkpointing_bad_values(value):
    with pytest.raises(ConfigError, match="gradient_checkpointing") as e:
        ModelConfig(tiny={}, gradient_checkpointing=value)
    assert e.value.path == "gradient_checkpointing"


def test_config_gradient_checkpointing_from_the_command_line():
    from rlcu.config import SFTConfig

    assert load_config(SFTConfig, None, ["model.gradient_checkpointing=12"]).model.gradient_checkpointing == 12
    assert load_config(SFTConfig, None, ["model.gradient_checkpointing=auto"]).model.gradient_checkpointing == "auto"
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        load_config(SFTConfig, None, ["model.gradient_checkpointing=sometimes"])


# ---------------------------------------------------------------- the trainers resolve auto
def _rl_dict(tmp_path, **kw):
    tok = syn.make_tokenizer()
    d = dict(model=dict(tiny=dict(RL_TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), init_seed=3,
                        gradient_checkpointing="auto"),
             steps=1, prompts_per_step=2, group_size=2, max_new_tokens=3, micro_batch_tokens=64,
             optim=dict(lr=3e-3), rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"}],
             log=dict(out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(save_at_end=False), engine=dict(block_size=16), seed=5)
    d.update(kw)
    return d, tok


def _log(tmp_path):
    return (tmp_path / "run" / "log.txt").read_text()


def test_grpo_resolves_auto_at_its_first_update(tmp_path):
    from rlcu.config import GRPOConfig, _build
    from rlcu.train.grpo import GRPOTrainer

    d, tok = _rl_dict(tmp_path)
    tr = GRPOTrainer(_build(GRPOConfig, d), syn.sort_rows(16, "train", min_len=2, max_len=3), tokenizer=tok)
    assert tr.model.gradient_checkpointing == "auto"  # nothing decided before the first update
    hist = tr.train()
    L = RL_TINY["num_hidden_layers"]
    assert len(hist) == 1 and math.isfinite(hist[0]["loss"])
    assert tr.model.gradient_checkpointing == L and type(tr.model.gradient_checkpointing) is int
    assert f"gradient checkpointing auto: all {L} layers checkpointed" in _log(tmp_path)


def test_ppo_resolves_auto_for_policy_and_critic(tmp_path):
    from rlcu.config import PPOConfig, _build
    from rlcu.train.ppo import PPOTrainer

    d, tok = _rl_dict(tmp_path, critic=dict(optim=dict(lr=3e-3)))
    tr = PPOTrainer(_build(PPOConfig, d), syn.sort_rows(16, "train", min_len=2, max_len=3), tokenizer=tok)
    assert tr.critic.gradient_checkpointing == "auto"
    hist = tr.train()
    L = RL_TINY["num_hidden_layers"]
    assert len(hist) == 1 and math.isfinite(hist[0]["vf_loss"])
    for m in (tr.model, tr.critic, tr.critic.trunk):
        assert m.gradient_checkpointing == L and type(m.gradient_checkpointing) is int, m
    est = job_memory(tr._memory_shape())  # the critic is the memory model's: its buffers, to the byte
    c, co = tr.critic, tr.critic_opt
    held = [c.flat, co.m, co.v, None if co.master_is_model else co.master]
    assert est.critic == sum(t.numel() * t.element_size() for t in held if t is not None)
    assert est.critic_gradients == c.layout.numel * torch.empty((), dtype=c.grad_dtype).element_size()
    assert f"gradient checkpointing auto: all {L} layers checkpointed" in _log(tmp_path)


def test_sft_resolves_auto_at_its_first_step(tmp_path):
    from rlcu.train.sft import SFTTrainer

    tiny = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_token_ids": torch.randint(0, 61, (3,), generator=g).tolist(),
             "completion_token_ids": torch.randint(0, 61, (4,), generator=g).tolist()} for _ in range(6)]
    cfg = {"model": {"tiny": tiny, "gradient_checkpointing": "auto"}, "steps": 2, "batch_tokens": 24,
           "optim": {"lr": 1e-3},
           "log": {"out_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False, "plot": False}}
    tr = SFTTrainer(cfg, rows)
    assert tr.model.gradient_checkpointing == "auto"
    last = tr.train()
    assert tr.step == 2 and math.isfinite(last["loss"]) and last["skipped"] == 0
    assert tr.model.gradient_checkpointing == 3 and type(tr.model.gradient_checkpointing) is int
    log = _log(tmp_path)
    assert "gradient checkpointing auto: all 3 layers checkpointed" in log
    assert log.count("gradient checkpointing auto") == 1  # decided once, not at every step


def test_a_number_of_layers_past_the_model_is_a_config_error(tmp_path):
    from rlcu.config import GRPOConfig, _build
    from rlcu.train.grpo import GRPOTrainer

    d, tok = _rl_dict(tmp_path)
    d["model"]["gradient_checkpointing"] = RL_TINY["num_hidden_layers"] + 3
    with pytest.raises(ConfigError, match=r"model\.gradient_checkpointing.*checkpoints 5 layers; the model has 2"):
        GRPOTrainer(_build(GRPOConfig, d), syn.sort_rows(16, "train", min_len=2, max_len=3), tokenizer=tok)


def test_the_estimate_rejects_what_the_model_rejects():
    cfg = Qwen3Config(**SMALL)
    for bad in (-1, cfg.num_hidden_layers + 1, "sometimes"):
        with pytest.raises(ValueError, match="checkpointing"):
            kept_activation_bytes(cfg, 64, 2, bad)


def test_an_unresolved_auto_is_estimated_at_the_layers_it_will_become():
    m, o = _small_model_and_opt()

    def est():
        return job_memory(sizing.run_shape(m, o, micro_batch_tokens=64, fused_head=True))

    m.gradient_checkpointing = "auto"  # on the CPU: every layer, as resolve_auto will decide
    auto = est()
    m.gradient_checkpointing = m.cfg.num_hidden_layers
    assert auto == est()
    m.gradient_checkpointing = "none"
    assert est().kept_activations > auto.kept_activations


@pytest.mark.gpu
def test_auto_on_the_gpu_keeps_what_fits_and_gives_the_same_gradients():
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW

    m = rlcu.Qwen3.from_config(Qwen3Config(**SMALL), device="cuda", dtype=torch.float32, seed=1)
    o = FlatAdamW(m, OptimConfig())
    tokens = torch.randint(0, m.cfg.vocab_size, (96,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32, device="cuda")
    dlp = torch.randn(96, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    grads = {}
    for mode in (True, "auto"):
        m.gradient_checkpointing = mode
        if mode == "auto":
            msg = sizing.resolve_auto(m, sizing.run_shape(m, o, micro_batch_tokens=96, fused_head=False))
            assert m.gradient_checkpointing == 0, msg  # a tiny model's activations fit a GPU many times
            assert "0 of 3 layers checkpointed" in msg and "GiB" in msg
        m.zero_grad()
        m.forward(tokens, cu)
        m.backward(dlp)
        grads[mode] = m.grad_flat.clone()
    assert torch.equal(grads[True], grads["auto"])
