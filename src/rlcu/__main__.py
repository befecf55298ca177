"""`python -m rlcu ...`: the `rlcu` command, and the entry point torchrun launches:

    torchrun --nproc-per-node 8 -m rlcu grpo CONFIG.yaml [--set ...]

Under torchrun with more than one rank the process group is set up first (rlcu.parallel: NCCL with
one GPU a rank, gloo on the CPU) and torn down at the end; a rank that raises tells the others,
whose watchdogs end them with the rank's error. Otherwise this is exactly `rlcu`.
"""

from __future__ import annotations

import sys

from rlcu import cli
from rlcu.parallel.comm import ranked


def main(argv: list[str] | None = None) -> int:
    return ranked(cli.main, argv)


if __name__ == "__main__":
    sys.exit(main())
