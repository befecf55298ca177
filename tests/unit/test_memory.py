"""The memory model (rlcu.memory): each part by a hand sum at a small odd shape, the phases and
the request, against the peaks the benchmarks measured on an H200 (bench/results), the 8-H200
targets, and the buffers the optimizers really allocate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.shapes import BF16, SHAPES

import rlcu
from rlcu.config import OptimConfig
from rlcu.memory import CONTEXT_BYTES, FRAGMENTATION, EngineShape, GiB, JobShape, job_memory, parts
from rlcu.memory.fit import kv_blocks_for_lease, kv_blocks_within, step_kv_blocks
from rlcu.model.config import Qwen3Config

RESULTS = Path(__file__).parents[2] / "bench" / "results"
H200_GiB = 139.0  # what an H200 offers a process (torch.cuda.mem_get_info on the device machine)
# V=333, H=96, I=160, 3 layers, 3 heads of 32 (q=96), 1 kv head (kv=32)
ODD = dict(vocab_size=333, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=3,
           num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
# the flat layout, each slot rounded up to 64 elements: embed 333 x 96 = 31968 -> 32000; a layer's input
# norm 96 -> 128, qkv 160 x 96, q and k norms 32 -> 64 each, o 96 x 96, post norm 128, gate_up 320 x 96, down 96 x 160
LAYER = 128 + 15360 + 64 + 64 + 9216 + 128 + 30720 + 15360
P = 32000 + 3 * LAYER + 128
GRPO_KV = 32 * 8 * (128 + 256 + 16)  # a step's sequences (32 prompts x 8, 128 + 256 tokens)


def odd(**kw) -> JobShape:
    return JobShape(Qwen3Config(**ODD), **kw)


# ---------------------------------------------------------------- the parts by hand
def test_what_a_rank_keeps_by_hand():
    s = odd()
    assert parts.params(s.cfg) == P == 245248
    assert (parts.weights(s), parts.master(s), parts.optimizer_state(s), parts.gradients(s)) == (2 * P, 4 * P, 8 * P,
                                                                                                4 * P)
    assert parts.grad_buckets(s) == 0 and parts.reference(s) == 0 and parts.critic(s) == 0
    bf16 = odd(**BF16)
    assert (parts.master(bf16), parts.optimizer_state(bf16), parts.gradients(bf16)) == (0, 4 * P, 2 * P)
    fp32 = odd(weight_bytes=4)  # fp32 weights are their own master
    assert parts.weights(fp32) == 4 * P and parts.master(fp32) == 0
    assert parts.master(odd(optimizer=False)) == parts.optimizer_state(odd(optimizer=False)) == 0
    assert parts.reference(odd(reference=True)) == 2 * P
    head = 128  # the critic's value head: H + 1 = 97 -> 128
    assert parts.critic(odd(critic=True)) == (P + head) * (2 + 4 + 8)
    assert parts.critic_gradients(odd(critic=True)) == (P + head) * 4
    assert parts.init_staging(s) == 0 and parts.init_staging(odd(random_init=True)) == 4 * P


def test_data_parallel_shards_and_buckets_by_hand():
    # buckets: the embedding 32000, three layers of LAYER, the final norm 128; 3 ranks: chunks of
    # ceil(size / 3) = 10667, 23680, 43
    s3 = odd(world_size=3)
    assert parts.shard(s3) == 10667 + 3 * 23680 + 43
    assert parts.master(s3) == 4 * parts.shard(s3) and parts.gradients(s3) == 4 * parts.shard(s3)
    # overlapped: the embedding's, the final norm's and MAX_INFLIGHT + 1 = 3 layers' buckets, padded
    assert parts.grad_buckets(s3) == 4 * (32001 + 129 + 3 * 3 * 23680)
    assert parts.grad_buckets(odd(world_size=3, overlap=False)) == 4 * P  # the full buffer
    assert parts.shard(odd(world_size=2)) == P // 2


def test_activations_per_token_by_hand():
    cfg, ab = Qwen3Config(**ODD), 2
    # h1, qkv, q, k, v, o, x2, h2, gu, a: 2 x (3 H + 3 q + 4 kv + 3 I); fp32 r1, r2, rq, rk, lse: 4 x (2 + 2 Hq + Hk)
    assert parts.layer_acts(cfg, ab) == 2 * (288 + 288 + 128 + 480) + 4 * 9 == 2404
    assert [parts.kept(cfg, ab, k) for k in ("inputs", "attention", "all")] == [192, 192 + 192 + 12, 192 + 2404]
    assert [parts.recompute(cfg, ab, k) for k in ("inputs", "attention", "all")] == [2404, 2404 - 204, 0]
    # da, dgu: 3 I; dh2, dx2, dh1, dx: 4 H; do, dq, dqn, dq0, dqkv's q: 5 q; 6 kv; and dy
    assert parts.backward_work(cfg, ab) == 2 * (384 + 480 + 192 + 480) + 192 == 3264
    T = 63
    assert parts.head_tile(odd(micro_batch_tokens=T)) == T * 333 * 2  # 63 rows < chunk_rows
    rows = 4096  # more tokens than the tile's rows: the tile is chunk_rows(333) rows of 333 bf16 logits
    assert parts.head_tile(odd(micro_batch_tokens=10_000)) == rows * 333 * 2


@pytest.mark.parametrize("fused,head_rows", [(True, 3 * 192 + 4 + 16 + 4 + 4), (False, 3 * 192 + 4 + 16 + 4 + 208)])
def test_a_micro_batch_by_hand(fused, head_rows):
    T = 63
    s = odd(micro_batch_tokens=T, fused_head=fused)
    assert parts.kept_activations(s) == T * 3 * 192  # full checkpointing: each layer's input
    # at the last layer: every input kept, the layer recomputed, its backward, the head's leftovers
    assert parts.layer_work(s) == T * (2404 + 3264 + head_rows)
    assert parts.head_work(s) == T * (3 * 192 + 4 + 12 + 16) + T * 333 * 2
    one = odd(micro_batch_tokens=T, fused_head=fused, checkpointing=1)  # layer 0 checkpointed, 1 and 2 keep all
    assert parts.kept_activations(one) == T * (192 + 2 * 2596)
    assert parts.layer_work(one) == T * (3264 + head_rows)  # layer 2's backward: nothing recomputed
    m = job_memory(s)
    assert m.phases()["actor_train"] == m.kept_activations + max(m.layer_work, m.head_work)
    assert parts.ref_forward(s) == 0
    assert parts.ref_forward(odd(micro_batch_tokens=T, reference=True)) == max(T * (384 + 2404),
                                                                                T * (576 + 28) + T * 666)


def test_the_engine_by_hand():
    cfg = Qwen3Config(**ODD)
    assert parts.kv_token_bytes(cfg, 2) == 2 * 3 * 32 * 2 == 384
    assert parts.kv_block_bytes(cfg, 16, 2) == 16 * 384
    assert parts.trunk_step(cfg, 2, 100) == 100 * (2 * (192 + 192 + 480) + 4)  # x, q, o, h, gu, a; rstd
    assert parts.head_step(cfg, 2, 7) == 7 * (2 * (96 + 333) + 12)  # hidden rows, logits; token, logprob
    e = EngineShape(kv_tokens=1000, max_num_seqs=7, budget=100, decode_graphs=True, prefill_graph_rows=50)
    s = odd(engine=e)
    assert parts.kv_pool(s) == 1000 * 384
    assert parts.engine_step(s) == max(173200, 6090) and parts.decode_graphs(s) == 6090
    assert parts.prefill_graphs(s) == 173200 + 50 * 192 and parts.prefill_graphs(s, 5000) == 5000 + 50 * 192
    plain = odd(engine=EngineShape(kv_tokens=1000, max_num_seqs=7, budget=100))
    assert parts.decode_graphs(plain) == parts.prefill_graphs(plain) == 0
    m = job_memory(s)
    assert m.phases()["rollout"] == 1000 * 384 + 173200 + 173200 + 9600
    assert m.decode_graphs == 6090 and m.resident == 2 * P + 4 * P + 8 * P + 4 * P + 6090 + parts.CUBLAS_WORKSPACE


def test_what_fits():
    e = EngineShape(kv_tokens=0, max_num_seqs=7, budget=100, decode_graphs=True, prefill_graph_rows=50)
    s = odd(engine=e)
    aside = 173200 + 6090 + 173200 + 9600
    assert kv_blocks_within(aside + 10 * 6144 + 5, s, 16) == 10
    assert kv_blocks_within(aside + 10 * 6144 + 5, s, 16, step_bytes=200_000, decode_graph_bytes=0) == (
        (aside + 10 * 6144 + 5 - 200_000 - 200_000 - 9600) // 6144)
    # a rollout lease granted for a pool gives that pool back
    pooled = odd(engine=EngineShape(kv_tokens=64 * 16, max_num_seqs=7, budget=100, decode_graphs=True))
    lease = job_memory(pooled).request()["rollout"] * GiB
    assert kv_blocks_for_lease(lease, pooled, 16) == 64
    assert step_kv_blocks(30, 20, 16, 8) == 4 * 9 + 16  # ceil(51 / 16) blocks a sequence, one more, 16 spare


def test_phases_peak_and_request():
    s = odd(micro_batch_tokens=63, release_grads=True, reference=True,
            engine=EngineShape(kv_tokens=1000, max_num_seqs=7, budget=100))
    m = job_memory(s)
    assert m.resident == 2 * P + 4 * P + 8 * P + 2 * P + parts.CUBLAS_WORKSPACE  # no gradient: released
    ph = m.phases()
    assert ph["actor_train"] == 4 * P + m.kept_activations + max(m.layer_work, m.head_work)
    assert ph["ref_logprobs"] == parts.ref_forward(s) and ph["init"] == 0 and "critic_train" not in ph
    drawn = job_memory(JobShape(Qwen3Config(), optimizer=False, random_init=True))  # fp32 beside the bf16 weights
    assert drawn.phases()["init"] == 4 * parts.params(Qwen3Config()) - parts.CUBLAS_WORKSPACE
    assert m.peak == m.resident + max(ph.values()) and m.total("rollout") == m.resident + ph["rollout"]
    req = m.request()
    assert req["resident"] == pytest.approx((m.resident * FRAGMENTATION + CONTEXT_BYTES) / GiB, rel=1e-9)
    assert req["actor_train"] == pytest.approx(ph["actor_train"] * FRAGMENTATION / GiB)
    ppo = job_memory(s.with_(critic=True))
    assert ppo.phases()["critic_train"] == 4 * P + ppo.critic_gradients + ppo.kept_activations + ppo.layer_work
    line = m.summary()
    assert line.startswith("memory per rank (estimate, 1 rank): peak") and "kv pool" in line


def test_reward_models_by_hand():
    """A reward model's weights (its flat buffer: the trunk without an LM head, the head's H + 1 ->
    128), resident or on the device only in the rollout when offloaded; its scoring forward of T
    tokens (a layer's input and output, its activations) beside the engine's step, not on it."""
    from rlcu.memory import RewardModelShape
    from rlcu.train.sizing import choose_offload

    untied = Qwen3Config(**dict(ODD, tie_word_embeddings=False))  # its LM head is not held
    rm, T = RewardModelShape(untied, tokens=63), 63
    eng = EngineShape(kv_tokens=1000, max_num_seqs=7, budget=100)
    s = odd(micro_batch_tokens=63, engine=eng, reward_models=(rm,))
    m = job_memory(s)
    assert m.reward_model == (P + 128) * 2 and m.reward_model_offloaded == 0
    assert m.reward_work == T * (2 * 2 * 96 + 2404)
    assert m.resident == job_memory(odd(micro_batch_tokens=63, engine=eng)).resident + (P + 128) * 2
    assert m.phases()["rollout"] == m.kv_pool + max(m.engine_step, m.reward_work)
    off = job_memory(s.with_(reward_models=(RewardModelShape(untied, tokens=63, offload=True),)))
    assert off.reward_model == 0 and off.reward_model_offloaded == (P + 128) * 2
    assert off.phases()["rollout"] == off.kv_pool + max(off.engine_step, (P + 128) * 2 + off.reward_work)
    assert off.resident == m.resident - (P + 128) * 2
    # offload auto: kept where the peak fits the budget, offloaded where only that fits
    need = m.device_bytes(m.peak)
    assert choose_offload(s, [0], need).reward_models[0].offload is False
    assert choose_offload(s, [0], need - 1).reward_models[0].offload is True
    assert choose_offload(s, [], 0) is s and choose_offload(s, [0], None) is s


def test_the_shape_checks_its_fields():
    with pytest.raises(ValueError, match="checkpointing"):
        odd(checkpointing="sometimes")
    with pytest.raises(ValueError, match=r"\[0, 3\], got 4"):
        odd(checkpointing=4)
    with pytest.raises(ValueError, match="JobShape.world_size"):
        odd(world_size=0)
    with pytest.raises(ValueError, match="EngineShape.budget"):
        EngineShape(kv_tokens=0, budget=0)


# ---------------------------------------------------------------- against the H200
def _bench_peaks():
    """(shape, precisions, tokens, checkpointing, fused head, measured GiB) of the train-step
    benchmarks (bench/train_step.py: max_memory_allocated over a step, less what was allocated
    before the model)."""
    out = []
    for name, shape in (("train_step.json", {}), ("train_step_4b.json", SHAPES["4b"]),
                        ("train_step_8b.json", SHAPES["8b"])):
        d = json.loads((RESULTS / name).read_text())
        prec = BF16 if d["memory_mode"] == "bf16" else {}
        T = {"0.6b": 32 * 1024}.get(d["shape"], 8 * 2048)
        for side in ("rlcu", "rlcu_fast", "rlcu_auto"):
            if side in d:
                r = d[side]
                out.append((name, side, shape, prec, T, r["gradient_checkpointing"], "fused" in r["what"],
                            r["peak_GiB"]))
    return out


@pytest.mark.parametrize("case", _bench_peaks(), ids=lambda c: f"{c[0]}:{c[1]}")
def test_train_steps_match_the_peaks_an_h200_measured(case):
    _, _, shape, prec, T, ckpt, fused, measured = case
    est = job_memory(JobShape(Qwen3Config(**shape), micro_batch_tokens=T, checkpointing=ckpt, fused_head=fused,
                              **prec)).total("actor_train") / GiB
    assert abs(est - measured) / measured < 0.01, (est, measured)


@pytest.mark.parametrize("shape,kw,measured", [
    ("4b", dict(micro_batch_tokens=8 * 2048), 41.5),  # train step 8 x 2048, bf16 memory mode
    ("8b", dict(micro_batch_tokens=8 * 2048), 75.0),
    ("4b", dict(micro_batch_tokens=8192, release_grads=True, engine=EngineShape(kv_tokens=GRPO_KV)), 37.0),
    ("8b", dict(micro_batch_tokens=8192, release_grads=True, engine=EngineShape(kv_tokens=GRPO_KV)), 71.0),
])
def test_one_gpu_device_need_matches_measured_peaks(shape, kw, measured):
    """The device's peaks the first estimate was checked against (GiB of device memory)."""
    m = job_memory(JobShape(Qwen3Config(**SHAPES[shape]), fused_head=False, **BF16, **kw))
    est = m.device_bytes(m.peak) / GiB
    assert abs(est - measured) / measured < 0.15, (shape, est, measured)


def test_eight_h200_targets():
    kv = EngineShape(kv_tokens=GRPO_KV // 8)
    e14 = job_memory(JobShape(Qwen3Config(**SHAPES["14b"]), world_size=8, micro_batch_tokens=16384,
                              engine=kv))  # default precision
    e32 = job_memory(JobShape(Qwen3Config(**SHAPES["32b"]), world_size=8, micro_batch_tokens=8192, engine=kv, **BF16))
    print(e14.summary())
    print(e32.summary())
    assert e14.device_bytes(e14.peak) / GiB < H200_GiB and e32.device_bytes(e32.peak) / GiB < H200_GiB
    # and what makes them fit: one GPU holds neither, nor 8 without the overlapped buckets for 32B
    one14 = job_memory(e14.shape.with_(world_size=1))
    one32 = job_memory(e32.shape.with_(world_size=1, engine=None))
    assert one14.device_bytes(one14.peak) / GiB > H200_GiB and one32.device_bytes(one32.peak) / GiB > H200_GiB
    no_overlap = job_memory(e32.shape.with_(overlap=False))
    assert no_overlap.peak > e32.peak + 50 * GiB  # a full gradient buffer per rank


@pytest.mark.parametrize("mode", [dict(), dict(master_weights=False, state_dtype="bfloat16", grad_dtype="bfloat16")])
def test_the_model_counts_the_buffers_the_optimizers_allocate(mode):
    from rlcu.optim import FlatAdamW
    from rlcu.parallel.comm import World
    from rlcu.parallel.zero import ShardedAdamW
    from rlcu.train.sizing import run_shape

    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    oc = OptimConfig(**mode)
    m1 = rlcu.Qwen3.from_config(cfg, dtype=torch.bfloat16)
    o1 = FlatAdamW(m1, oc)
    e1 = job_memory(run_shape(m1, o1, micro_batch_tokens=64, fused_head=True))
    assert e1.master + e1.optimizer_state == sum(o1.state_bytes().values())
    m1.zero_grad()
    assert e1.gradients == m1.grad_flat.numel() * m1.grad_flat.element_size()
    assert e1.weights == m1.flat.numel() * m1.flat.element_size()
    for rank in range(3):  # no process group is needed to build the shards
        m = rlcu.Qwen3.from_config(cfg, dtype=torch.bfloat16)
        o = ShardedAdamW(m, oc, World(rank=rank, size=3, backend="gloo"))
        e = job_memory(run_shape(m, o, micro_batch_tokens=64, fused_head=True).with_(world_size=3))
        assert e.master + e.optimizer_state == sum(o.state_bytes().values())
        m.zero_grad()
        assert e.gradients == o.sink.shard.numel() * o.sink.shard.element_size()
        assert m.grad_flat is None  # no full-size gradient buffer in the overlapped mode
        assert 2.9 * e.optimizer_state < e1.optimizer_state < 3.1 * e.optimizer_state
