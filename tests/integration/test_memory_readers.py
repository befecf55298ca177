"""Every reader of the memory model reads it: the engine's pool sizing, the RL trainer's one-step
pool and its shape, the per-rank estimate logged at a run's start. (`gradient_checkpointing:
auto`: test_checkpointing_auto.py; the scheduler's request and lease: test_sched_job.py.)"""

from __future__ import annotations

import types

import pytest
import torch

from rlcu.data import synthetic as syn
from rlcu.engine import kv_pool
from rlcu.engine.prefill_graphs import kept_output_rows
from rlcu.memory import JobShape, job_memory, parts
from rlcu.model.config import Qwen3Config
from rlcu.parallel.comm import World
from rlcu.train import sizing

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def test_the_engine_pool_sets_aside_what_the_model_says(monkeypatch):
    """On CUDA (the device's answers stood in for): the pool is what gpu_memory_utilization
    leaves once the probed step, the probed decode step and the prefill graphs' pool (the
    probed step and every smaller bucket's output rows) are set aside, in blocks of the model's
    bytes."""
    cfg = Qwen3Config(**SMALL)
    model = types.SimpleNamespace(cfg=cfg, dtype=torch.bfloat16, device=torch.device("cuda"))
    step, decode = 5_000_000, 700_000
    free, total = 70 << 30, 100 << 30
    monkeypatch.setattr(kv_pool, "probe_memory", lambda m, **kw: (step, decode))
    monkeypatch.setattr(kv_pool.torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(kv_pool.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kv_pool.torch.cuda, "mem_get_info", lambda d=None: (free, total))
    n, probe = kv_pool.auto_num_blocks(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096,
                                       max_model_len=256, gpu_memory_utilization=0.5, graphs=True,
                                       prefill_graphs=True)
    prefill = step + kept_output_rows(4096) * 64 * 2
    assert probe == {"activation_bytes": step, "graph_bytes": decode, "prefill_graph_bytes": prefill}
    block = 16 * 2 * 3 * 2 * 16 * 2  # 16 tokens' K and V, 3 layers, 2 kv heads of 16, bf16
    assert kv_pool.block_bytes(cfg, 16, torch.bfloat16) == block == parts.kv_block_bytes(cfg, 16, 2)
    assert n == (total // 2 - (total - free) - step - decode - prefill) // block
    # without graphs nothing is set aside for them
    n2, probe2 = kv_pool.auto_num_blocks(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096,
                                         max_model_len=256, gpu_memory_utilization=0.5, graphs=False)
    assert probe2["prefill_graph_bytes"] == 0 and n2 == (total // 2 - (total - free) - step - decode) // block
    monkeypatch.setattr(kv_pool.torch.cuda, "mem_get_info", lambda d=None: (40 << 30, total))  # 60 of 100 in use
    with pytest.raises(RuntimeError, match="gpu_memory_utilization=0.5 leaves no room for the KV cache"):
        kv_pool.auto_num_blocks(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=256,
                                gpu_memory_utilization=0.5, graphs=False)


def test_the_engine_pool_off_cuda():
    cfg = Qwen3Config(**SMALL)
    model = types.SimpleNamespace(cfg=cfg, dtype=torch.float32, device=torch.device("cpu"))
    n, probe = kv_pool.auto_num_blocks(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=100,
                                       max_model_len=40, gpu_memory_utilization=0.5, graphs=False)
    assert (n, probe) == (-(-160 // 16), {})  # 4 longest sequences
    big = Qwen3Config(**dict(SMALL, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=64))
    n, _ = kv_pool.auto_num_blocks(types.SimpleNamespace(cfg=big, dtype=torch.float32, device=torch.device("cpu")),
                                   block_size=16, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=40960,
                                   gpu_memory_utilization=0.5, graphs=False)
    assert n == kv_pool.CPU_KV_BYTES // parts.kv_block_bytes(big, 16, 4)  # at most 1 GiB


def _grpo(tmp_path, **kw):
    from rlcu.config import GRPOConfig, _build
    from rlcu.train.grpo import GRPOTrainer

    tok = syn.make_tokenizer()
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
                rope_theta=10000.0, bos_token_id=None, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)
    d = dict(model=dict(tiny=tiny, init_seed=3), steps=1, prompts_per_step=3, group_size=2, max_new_tokens=5,
             micro_batch_tokens=64, optim=dict(lr=3e-3), rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"}],
             log=dict(out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(save_at_end=False), engine=dict(block_size=4), seed=5, kl_coef=0.1)
    d.update(kw)
    cfg = _build(GRPOConfig, d)
    return GRPOTrainer(cfg, syn.sort_rows(16, "train", min_len=2, max_len=5), tokenizer=tok), cfg


def test_the_rl_trainer_takes_one_steps_pool_and_describes_its_job(tmp_path):
    tr, cfg = _grpo(tmp_path)
    longest = max(r.longest for r in tr.prompt_reports)
    eval_prompts = min(len(tr.eval_rows), cfg.eval_max_prompts)
    want = sizing.rl_kv_blocks(cfg, 1, longest, eval_prompts)
    # one step's 6 sequences (or an evaluation's prompts), each its longest prompt and 5 new tokens
    per_seq = -(-(longest + 5 + 1) // 4)
    assert want == per_seq * (max(6, eval_prompts) + 1) + 16 == tr.llm.runner.num_blocks
    shape = tr._memory_shape()
    assert shape.engine.kv_tokens == want * 4 and shape.reference and not shape.critic and shape.release_grads
    assert (shape.weight_bytes, shape.micro_batch_tokens, shape.fused_head) == (4, 64, True)
    assert job_memory(shape).reference == tr.ref.flat.numel() * tr.ref.flat.element_size()
    assert job_memory(shape).kv_pool == tr.llm.runner.num_blocks * tr.llm.runner.block_bytes


def test_the_estimate_logged_at_the_start(tmp_path):
    lines = []
    log = types.SimpleNamespace(info=lines.append)
    shape = JobShape(Qwen3Config(**SMALL), world_size=2, micro_batch_tokens=96)
    assert sizing.log_estimate(log, shape, torch.device("cpu"), World()) is None and not lines  # one CPU process
    line = sizing.log_estimate(log, shape, torch.device("cpu"), World(rank=0, size=2))
    assert lines == [line] == [job_memory(shape).summary()]
    assert line.startswith("memory per rank (estimate, 2 ranks)")
    assert sizing.log_estimate(log, shape, torch.device("cuda"), World()) == line  # a GPU run logs it too


def test_the_sft_trainer_describes_its_job(tmp_path):
    from rlcu.train.sft import SFTTrainer

    tiny = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    rows = [{"prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5, 6, 7]} for _ in range(4)]
    cfg = {"model": {"tiny": tiny, "gradient_checkpointing": "attention"}, "steps": 1, "batch_tokens": 24,
           "log": {"out_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False, "plot": False}}
    shape = SFTTrainer(cfg, rows)._memory_shape()
    assert (shape.micro_batch_tokens, shape.fused_head, shape.checkpointing, shape.engine) == (24, False, "attention",
                                                                                               None)
    assert not shape.release_grads and not shape.reference and shape.weight_bytes == 4
