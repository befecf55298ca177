"""The benches' MoE arithmetic (issue 37): the 30B-A3B shapes (the cut one: the layers whose full
fine-tuning fits one H200 by the memory model), the active parameters MFU counts, and the
generation bound's expert bytes a step reads."""

import pytest

common = pytest.importorskip("bench.common")
generate = pytest.importorskip("bench.generate")
train_step = pytest.importorskip("bench.train_step")

from rlcu.memory import GiB, JobShape, job_memory  # noqa: E402
from rlcu.memory.parts import params  # noqa: E402
from rlcu.model.config import Qwen3Config  # noqa: E402

H200_GiB = 139.0  # what an H200 offers a process (tests/unit/test_memory.py)
A3B = Qwen3Config(**common.SHAPES["qwen3-30b-a3b"])


def test_the_30b_a3b_shape():
    assert params(A3B) == pytest.approx(30.53e9, rel=1e-3)  # Qwen3-30B-A3B: 30.5B parameters
    assert common.matmul_params(A3B) + A3B.vocab_size * A3B.hidden_size == pytest.approx(3.35e9, rel=1e-2)  # A3B
    assert common.shape_name("qwen3-30b-a3b") == "Qwen3-30B-A3B"


@pytest.mark.parametrize("ckpt,fused", [("full", False), ("attention", True), ("full", True)])
def test_the_cut_shape_is_the_most_layers_whose_full_fine_tuning_fits(ckpt, fused):
    """train_step.py's sides at 32 x 1024 tokens, fp32 master and moments."""
    def need(L):
        cfg = Qwen3Config(**dict(common.SHAPES["qwen3-30b-a3b"], num_hidden_layers=L))
        m = job_memory(JobShape(cfg, micro_batch_tokens=32 * 1024, checkpointing=ckpt, fused_head=fused,
                                random_init=True))
        return m.device_bytes(m.peak) / GiB

    L = common.SHAPES["qwen3-30b-a3b-cut"]["num_hidden_layers"]
    assert need(L) < H200_GiB < need(L + 1)


def test_active_parameters():
    """A dense model's every matmul weight; a MoE's sparse layers count their router and k of E
    experts (a dense layer of the MoE its whole MLP)."""
    dense = Qwen3Config()
    H, V = dense.hidden_size, dense.vocab_size
    attn = H * (dense.q_size + 2 * dense.kv_size) + dense.q_size * H
    assert common.matmul_params(dense) == 28 * (attn + 3 * 3072 * H) + V * H
    moe = Qwen3Config(**dict(common.SHAPES["qwen3-30b-a3b"], num_hidden_layers=4, mlp_only_layers=[2]))
    H = 2048
    attn = H * (32 * 128 + 2 * 4 * 128) + 32 * 128 * H
    assert common.matmul_params(moe) == 4 * attn + 3 * (H * 128 + 8 * 3 * 768 * H) + 3 * 6144 * H + 151936 * H
    # MFU's work: twice the active parameters a token, and causal attention's QK^T and PV
    assert train_step.fwd_flops_per_token(moe, 1024) == 2 * common.matmul_params(moe) + 4 * 2 * 2 * 4096 * 512


def test_the_generation_bound_reads_the_routed_experts():
    """A step's weight bytes: a one-token step reads k experts a sparse layer, a long prefill
    (nearly) all E; E (1 - (1 - k/E)^T) between; a dense model every weight."""
    wb = params(A3B) * 2
    expert = 3 * 768 * 2048 * 2
    assert common.expected_experts(128, 8, 1) == pytest.approx(8)
    assert common.expected_experts(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert generate.step_weight_bytes(A3B, wb, 1) == pytest.approx(wb - 48 * 120 * expert)
    assert generate.step_weight_bytes(A3B, wb, 4096) == pytest.approx(wb, rel=1e-9)
    dense = Qwen3Config()
    assert generate.step_weight_bytes(dense, 1234, 1) == 1234
    log = {"step_log": [(1, 1, 0, True, 1e-3), (64, 64, 0, True, 1e-3)]}
    tot, dec, _, _ = generate.bound_seconds(log, A3B, wb, 4e12)
    want = sum(generate.step_weight_bytes(A3B, wb, n) / 4e12 for n in (1, 64))
    assert tot == dec == pytest.approx(want)
    assert generate.step_weight_bytes(A3B, wb, 1) < wb / 8  # a decode step of one sequence: ~6.7 of 61 GB


@pytest.mark.usefixtures("one_thread")
def test_generate_quick_runs_a_moe(monkeypatch):
    """bench/generate.py --quick --shape qwen3-30b-a3b on the CPU: a small MoE of the shape's family,
    its bound from the routed experts' bytes."""
    got = {}
    monkeypatch.setattr(generate, "write_json", lambda name, payload: got.update(name=name, **payload) or name)
    assert generate.main(["--quick", "--shape", "qwen3-30b-a3b", "--no-hf", "--requests", "4"]) == 0
    assert got["name"] == "generate_quick_qwen3-30b-a3b.json" and got["config"]["layers"] == 2
    assert got["config"]["family"] == "qwen3_moe"
    r = got["rlcu"][0]
    assert r["output_tokens"] > 0 and 0 < r["bound_s"] < r["wall_s"]
