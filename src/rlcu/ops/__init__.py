"""Every non-matmul op of the model, one file each: Triton kernel(s), launcher, a plain
PyTorch reference twin, and the public `*_fwd` / `*_bwd` that pick between them."""

from rlcu.ops._backend import backend_name, use_triton  # noqa: F401
