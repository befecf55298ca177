"""Writing new keys and values into the paged KV cache.

The cache of one layer is two tensors [num_blocks, block_size, Hk, D]; token n of the step
goes to slot s = slot_mapping[n] = block * block_size + offset, i.e. row s of the cache seen
as [num_blocks * block_size, Hk, D]. A negative slot means "no write" (padding tokens of a
CUDA-graph batch, or tokens whose K/V is already cached). k and v may be strided views of the
fused qkv projection: only the last dimension must be contiguous.

The kernel is a gather-free scatter: one program per (token tile, KV head tile) copies
[BT, BH, D] of K and of V; it touches each byte once, so it is bound by memory bandwidth.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton

_TILE = 4096  # elements of K a program copies: BT tokens x BH heads x BD


@triton.jit(do_not_specialize=["N"])
def _kv_write_kernel(K, V, KC, VC, SLOT, N, H, D, stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_cs, stride_ch, BT: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BT + tl.arange(0, BT)  # [BT]
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    slot = tl.load(SLOT + t, mask=t < N, other=-1).to(tl.int64)  # [BT]
    mask = (slot >= 0)[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    k = tl.load(K + t[:, None, None] * stride_kn + h[None, :, None] * stride_kh + d[None, None, :],
                mask=mask, other=0.0)
    v = tl.load(V + t[:, None, None] * stride_vn + h[None, :, None] * stride_vh + d[None, None, :],
                mask=mask, other=0.0)
    c_off = slot[:, None, None] * stride_cs + h[None, :, None] * stride_ch + d[None, None, :]
    tl.store(KC + c_off, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + c_off, v.to(VC.dtype.element_ty), mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping):
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"kv_write: k and v must both be [N, Hk, D], got {list(k.shape)} and "
                         f"{list(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"kv_write: caches must be [num_blocks, block_size, {k.shape[1]}, "
                         f"{k.shape[2]}], got {list(k_cache.shape)} and {list(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kv_write: k_cache and v_cache must be contiguous")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_write: slot_mapping must be an int64 [{k.shape[0]}] tensor, got "
                         f"{slot_mapping.dtype} {list(slot_mapping.shape)}")


def kv_write_triton(k, v, k_cache, v_cache, slot_mapping):
    N, H, D = k.shape
    if N == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    BD, BH = triton.next_power_of_2(D), triton.next_power_of_2(H)
    BT = max(1, _TILE // (BD * BH))
    kc, vc = k_cache.view(-1, H, D), v_cache.view(-1, H, D)  # [slots, Hk, D]
    _kv_write_kernel[(triton.cdiv(N, BT),)](
        k, v, kc, vc, slot_mapping.contiguous(), N, H, D, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), kc.stride(0), kc.stride(1), BT=BT, BH=BH, BD=BD, num_warps=4)


def kv_write_ref(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    H, D = k.shape[1:]
    k_cache.view(-1, H, D).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, H, D).index_copy_(0, slots, v[keep].to(v_cache.dtype))


@dispatch(kv_write_triton, kv_write_ref, on="k")
def kv_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v: [N, Hk, D] (last dim contiguous); k_cache, v_cache: [num_blocks, block_size, Hk, D];
    slot_mapping: [N] int64, slot = block * block_size + offset, < 0 skips the token.
    Writes the caches in place."""
    _check(k, v, k_cache, v_cache, slot_mapping)
