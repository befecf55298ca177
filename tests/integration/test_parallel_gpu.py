"""The sharded optimizer's kernels: AdamW on slices of a buffer with `index_base` draws the
stochastic-rounding bits of the whole buffer (kernel through the interpreter on the CPU, and
the twin); on the GPU, a one-rank NCCL group runs the overlapped reduce-scatter, the shard
update and the all-gather bit for bit as FlatAdamW does."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.interp_util import needs_triton as needs_triton_for  # noqa: E402

from rlcu.ops import adamw as adamw_mod  # noqa: E402
from rlcu.ops.adamw import adamw_step  # noqa: E402

needs_triton = needs_triton_for(adamw_mod._adamw_kernel)

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, seed=11)


def _slices_vs_whole(n, cuts, device="cpu"):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g).to(device, torch.bfloat16)
    grads = [torch.randn(n, generator=g).to(device) for _ in range(3)]
    whole = [p0.clone(), torch.zeros(n, device=device, dtype=torch.bfloat16),
             torch.zeros(n, device=device, dtype=torch.bfloat16)]
    parts = [t.clone() for t in whole]
    for t, gr in enumerate(grads, start=1):
        adamw_step(*whole[:1], gr, *whole[1:], None, step=t, grad_scale=0.5, **HP)
        for a, b in zip(cuts[:-1], cuts[1:]):
            adamw_step(parts[0][a:b], gr[a:b], parts[1][a:b], parts[2][a:b], None, step=t, grad_scale=0.5,
                       index_base=a, **HP)
    return whole, parts


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_slices_with_index_base_round_as_the_whole_buffer(monkeypatch, backend):
    monkeypatch.setenv("RLCU_BACKEND", backend)
    monkeypatch.setattr(adamw_mod, "LAUNCH", {"sr": (256, 4), "plain": (256, 4)})
    whole, parts = _slices_vs_whole(1000, [0, 300, 301, 777, 1000])
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
    # without index_base a slice draws other bits: the test can tell
    p, m, v = (t.clone() for t in parts)
    p2 = p.clone()
    gr = torch.randn(1000)
    adamw_step(p[300:], gr[300:], m[300:], v[300:], None, step=4, grad_scale=1.0, index_base=300, **HP)
    adamw_step(p2[300:], gr[300:], m.clone()[300:], v.clone()[300:], None, step=4, grad_scale=1.0, **HP)
    assert not torch.equal(p, p2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [dict(), dict(master_weights=False, state_dtype="bfloat16", grad_dtype="bfloat16")])
def test_one_rank_nccl_sharded_equals_flat_adamw(mode):
    import torch.distributed as dist
    from support.parallel_util import free_port

    import rlcu
    from rlcu.config import OptimConfig
    from rlcu.optim import FlatAdamW
    from rlcu.parallel.comm import World
    from rlcu.parallel.zero import ShardedAdamW

    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}",
                                device_id=torch.device("cuda", 0))
    cfg = rlcu.Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    oc = OptimConfig(lr=1e-3, max_grad_norm=0.0, **mode)
    models = [rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=0) for _ in range(2)]
    opts = [FlatAdamW(models[0], oc), ShardedAdamW(models[1], oc, World(0, 1, 0, "nccl"))]
    assert opts[1].sink is not None
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        seqs = [torch.randint(0, 1000, (int(n),), generator=g).cuda() for n in (300, 200, 100)]
        for m, o in zip(models, opts):
            m.zero_grad()
            for s in seqs:  # three backward passes, each reduce-scattered bucket by bucket
                cu = torch.tensor([0, len(s)], dtype=torch.int32, device="cuda")
                m.forward_backward(s, cu, lambda lp, ent, idx: (torch.full_like(lp, -1e-3), None))
            o.step(1e-3)
    w0 = rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=0).flat.float()
    w1, w2 = models[0].flat.float(), models[1].flat.float()
    assert (w1 - w0).norm() > 0
    if not mode:  # fp32 gradients: each pass's bucket sums into the shard as acc_wgrad sums into the buffer
        assert torch.equal(w1, w2)
    else:  # bf16 gradients are rounded once more (the bucket, then the shard's sum); the same rounding bits
        assert float((w1 - w2).norm() / (w1 - w0).norm()) < 0.1
