"""The memory model with LoRA adapters (rlcu.memory `JobShape.adapter`): the adapters' weights,
fp32 master, moments and gradients by a hand sum at a small odd shape and against the buffers
LoraAdapters and FlatAdamW really allocate; the frozen base has no master, moments or gradient."""

import torch

import rlcu
from rlcu.config import OptimConfig
from rlcu.memory import AdapterShape, JobShape, job_memory, parts
from rlcu.model.config import Qwen3Config
from rlcu.model.lora import LoraAdapters, LoraConfig
from rlcu.optim import FlatAdamW

# H=96, I=160, 3 layers, q = 3 x 32, kv = 32 (test_memory.py's odd shape)
ODD = dict(vocab_size=333, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=3,
           num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
# q_proj and v_proj at r = 4: a layer's qkv A [8, 96] = 768 and B [96 + 32 + 32, 4] = 640 (its rows on qkv's
# columns, k's unused), both multiples of 64
QV = 3 * (768 + 640)


def test_adapter_parts_by_hand_and_the_frozen_base():
    cfg = Qwen3Config(**ODD)
    full = JobShape(cfg)
    s = full.with_(adapter=AdapterShape(r=4, target_modules=("v_proj", "q_proj")))
    assert parts.adapter_params(s) == QV and parts.adapter_params(full) == 0
    assert parts.adapters(s) == QV * (2 + 4 + 8) and parts.adapter_gradients(s) == 4 * QV
    assert parts.master(s) == parts.optimizer_state(s) == parts.gradients(s) == 0  # the base is frozen
    assert parts.weights(s) == parts.weights(full) and parts.grad_buckets(s.with_(world_size=2)) == 0
    m, mf = job_memory(s), job_memory(full)
    base_state = parts.master(full) + parts.optimizer_state(full) + parts.gradients(full)
    assert mf.resident - m.resident == base_state - parts.adapters(s) - parts.adapter_gradients(s)
    rl = job_memory(s.with_(release_grads=True))  # RL frees the adapters' gradient between steps too
    assert rl.resident == m.resident - 4 * QV and rl.phases()["actor_train"] >= 4 * QV
    # the backward's adapter work: h, dh, dH at the widest stacked rank (8), and with dropout a mask
    # and the masked input at the widest K (160, down_proj's)
    all_lin = s.with_(adapter=AdapterShape(r=4, target_modules="all-linear", dropout=True))
    assert parts.adapter_work(s) == 3 * 2 * 8 and parts.adapter_work(all_lin) == 3 * 2 * 12 + 5 * 160
    assert parts.layer_work(all_lin) - parts.layer_work(full) == 8192 * parts.adapter_work(all_lin)
    assert "adapters" in m.summary()


def test_adapter_parts_are_the_buffers_allocated():
    cfg = Qwen3Config(**ODD)
    lc = LoraConfig(r=4, target_modules="all-linear")
    shape = JobShape(cfg, adapter=AdapterShape(r=4, target_modules="all-linear"))
    bf16 = LoraAdapters.create(cfg, lc, dtype=torch.bfloat16)
    opt = FlatAdamW(bf16, OptimConfig())  # fp32 master and moments over the adapters' buffer alone
    held = bf16.flat.nbytes + sum(opt.state_bytes().values())
    assert held == parts.adapters(shape)
    m = rlcu.CausalLM.from_config(cfg)
    ad = LoraAdapters.create(cfg, lc).attach(m)
    tokens = torch.randint(0, 333, (9,))
    m.forward(tokens, torch.tensor([0, 9], dtype=torch.int32))
    m.backward(torch.ones(9))
    assert m.grad_flat is None and ad.grad_flat.nbytes == parts.adapter_gradients(shape)
    assert ad.flat.numel() == parts.adapter_params(shape)
