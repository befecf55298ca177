"""The `rlcu` command: `rlcu info`, and the subcommands of the engine, trainers and scheduler.

Each subcommand lives with its subsystem as a `main(argv) -> int` function; this file only
dispatches, so `rlcu --help` stays fast (nothing heavy is imported until a command runs).

A reader that goes away (`rlcu grpo --help | head`) ends any command quietly with status 141
(128 + SIGPIPE, what the shell shows for a C program that SIGPIPE killed), not with a
BrokenPipeError traceback: Python ignores SIGPIPE, so the write raises instead, and the
interpreter's last flush at exit would raise again unless the streams point elsewhere.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SIGPIPE_STATUS = 128 + 13  # signal.SIGPIPE is 13 on every POSIX system (and absent on Windows)

# command -> (module with main(argv), one-line help)
COMMANDS = {
    "info": ("rlcu.cli", "version, torch, triton, device and the op backend in use"),
    "demo": ("rlcu.train.demo", "train a tiny Qwen3 from scratch: SFT warm-up, then GRPO (the built-in demo)"),
    "generate": ("rlcu.engine.cli", "prompts JSONL in, completions JSONL out"),
    "sft": ("rlcu.train.cli", "supervised fine-tuning from a YAML config"),
    "dpo": ("rlcu.train.cli", "DPO (sigmoid or IPO loss) on preference pairs from a YAML config"),
    "grpo": ("rlcu.train.cli", "GRPO from a YAML config"),
    "ppo": ("rlcu.train.cli", "PPO (actor + critic) from a YAML config"),
    "rm": ("rlcu.train.cli", "reward-model training (Bradley-Terry on preference pairs) from a YAML config"),
    "merge": ("rlcu.model.merge_cli", "merge a PEFT LoRA adapter into its base: a full HF folder"),
    "sched": ("rlcu.sched.cli", "phase-aware multi-job GPU scheduler: serve, submit, status, cancel, simulate"),
}
# commands that compute with a model, which a stale RLCU_EXACT would have switched to exact mode
_MODEL_COMMANDS = ("demo", "generate", "sft", "dpo", "grpo", "ppo", "rm")


def info_main(argv: list[str]) -> int:
    import platform

    import torch

    import rlcu
    from rlcu.ops._backend import HAS_TRITON, backend_name

    p = argparse.ArgumentParser(prog="rlcu info", description=COMMANDS["info"][1])
    p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device)"
    tri = "not installed"
    if HAS_TRITON:
        import triton

        tri = triton.__version__
    rows = [
        ("rlcu", rlcu.__version__), ("python", platform.python_version()), ("torch", torch.__version__),
        ("triton", tri), ("device", dev),
        ("op backend", backend_name("cuda" if cuda else "cpu")),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        _drop_output()
        return SIGPIPE_STATUS


def _drop_output() -> None:
    """Point stdout and stderr at the null device, so that what is still buffered, and the
    interpreter's flush at exit, write nowhere instead of raising."""
    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(null, stream.fileno())
        except (OSError, ValueError, AttributeError):  # a stream without a file descriptor (replaced, closed)
            pass
    os.close(null)


def _dispatch(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rlcu COMMAND [options]\n\nLLM RL post-training (Qwen3, Qwen2/2.5, Llama 3.x, Mistral) with "
              "hand-written kernels.\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        print("\n`rlcu COMMAND --help` lists a command's options.")
        return 0
    if argv[0] in ("-V", "--version"):
        import rlcu

        print(rlcu.__version__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"rlcu: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if cmd == "info":
        return info_main(rest)
    if cmd in _MODEL_COMMANDS and os.environ.get("RLCU_EXACT", "").strip():
        print("rlcu: RLCU_EXACT is no longer read (exact mode is the model's): set `exact: true` in a GRPO or PPO "
              "config (--set exact=true) or pass --exact to rlcu generate, and unset RLCU_EXACT (docs/exact.md)",
              file=sys.stderr)
        return 2
    mod = importlib.import_module(COMMANDS[cmd][0])
    if cmd == "grpo":  # --scheduler: the trainers import nothing of the scheduler above them
        return int(mod.main([cmd] + rest, scheduled=scheduled_grpo) or 0)
    return int(mod.main([cmd] + rest) or 0)


def scheduled_grpo(prog: str, cfg, addr: str, job_name: str | None, sources: list[str] | None = None) -> int:
    """`rlcu grpo CONFIG --scheduler ADDR`: the run as a job of that scheduler (rlcu.sched.job);
    several configs (a list): one LoRA host, one job of the scheduler (rlcu.sched.host); one LoRA
    config in one process: joined into a running host of its base, else a host of its own."""
    if isinstance(cfg, list):
        from rlcu.sched.host import run_host_exit_code

        return run_host_exit_code(prog, cfg, addr, job_name, sources=sources)
    if cfg.lora.enabled and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        from rlcu.sched.host import submit_lora_exit_code

        return submit_lora_exit_code(prog, cfg, addr, job_name, source=(sources or [None])[0])
    from rlcu.sched.job import run_grpo_exit_code  # the scheduler's client loads for --scheduler only

    return run_grpo_exit_code(prog, cfg, addr, job_name, threads=True)


if __name__ == "__main__":
    sys.exit(main())
