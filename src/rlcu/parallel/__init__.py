"""Data parallelism across GPUs and nodes through torch.distributed, launched by torchrun:
the world and its collectives (comm.py), the failure watchdog (watchdog.py), the ZeRO-style
sharded optimizer (zero.py) and its checkpoints (ckpt.py), the global batch (batch.py) and the
per-rank memory estimate (memory.py). Without torchrun none of it is active."""
