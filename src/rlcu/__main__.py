"""`python -m rlcu ...`: the `rlcu` command, and the entry point torchrun launches:

    torchrun --nproc-per-node 8 -m rlcu grpo CONFIG.yaml [--set ...]

Under torchrun with more than one rank the process group is set up first (rlcu.parallel: NCCL with
one GPU a rank, gloo on the CPU) and torn down at the end; a rank that raises tells the others,
whose watchdogs end them with the rank's error. Otherwise this is exactly `rlcu`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from rlcu import cli

    return ranked(cli.main, argv)


def ranked(entry, argv: list[str] | None = None) -> int:
    """entry(argv) -> exit status, with the process group around it under torchrun (also
    `python -m rlcu.sched.job`, the worker of a submitted job of several ranks)."""
    from rlcu.parallel import comm as W

    try:
        w = W.env_world()
    except ValueError as e:
        print(f"rlcu: torchrun environment: {e}", file=sys.stderr)
        return 2
    if not w.distributed:
        W.watch_launcher()  # torchrun with one rank: its launcher may die too
        return entry(argv)
    try:
        W.init_from_env()
    except ValueError as e:  # a setup that cannot work (more ranks than GPUs, no MASTER_ADDR): one line
        print(f"rlcu: {e}", file=sys.stderr)
        return 2
    try:
        rc = entry(argv)
    except BaseException as e:
        W.report_failure(e)
        raise
    if rc:
        W.report_failure(RuntimeError(f"exited with status {rc}"))
        return rc
    W.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
