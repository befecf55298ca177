"""`rlcu sft | dpo | grpo | ppo | rm CONFIG.yaml [--set a.b=c ...] [--resume DIR|auto] [--overwrite]
[--allow-config-change]`.

The YAML file and the overrides build the run's config (rlcu.config: SFTConfig,
DPOConfig, GRPOConfig, PPOConfig, RMConfig); `--help` lists every option with its
default. Exit status: 0 done; 1 aborted after too many non-finite steps; 2 a run that cannot
start as asked, with one line naming why (a bad option with its dotted name and where it came
from, a log.out_dir that holds another run or cannot be written, a checkpoint that does not
fit, a device this machine lacks); 74 (rlcu.errors.NO_SPACE_STATUS) the disk filled up
mid-run, one line naming the file (the last checkpoint intact); 128 + N stopped by signal N
(SIGTERM: 143, SIGINT: 130) after checkpointing the step in flight.
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "sft": ("rlcu.config", "SFTConfig", "rlcu.train.sft", "SFTTrainer", "supervised fine-tuning"),
    "dpo": ("rlcu.config", "DPOConfig", "rlcu.train.dpo", "DPOTrainer", "DPO on preference pairs"),
    "grpo": ("rlcu.config", "GRPOConfig", "rlcu.train.grpo", "GRPOTrainer", "GRPO"),
    "ppo": ("rlcu.config", "PPOConfig", "rlcu.train.ppo", "PPOTrainer", "PPO with a critic"),
    "rm": ("rlcu.config", "RMConfig", "rlcu.train.reward_trainer", "RewardTrainer", "reward-model training"),
}


def _parser(cmd: str, scheduled: bool) -> argparse.ArgumentParser:
    what = COMMANDS[cmd][4]
    p = argparse.ArgumentParser(
        prog=f"rlcu {cmd}", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{what} from a YAML config. Every option below can be set in the YAML file "
                    f"(nested keys are sections) or with --set key.path=value.")
    if cmd == "grpo":
        p.add_argument("config", nargs="*", default=None,
                       help="YAML config file (default: all defaults); several: LoRA jobs on one base, run in one "
                            "process over one copy of it (a LoRA host: every config needs lora:, --set applies to all)")
    else:
        p.add_argument("config", nargs="?", default=None, help="YAML config file (default: all defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one option, e.g. --set optim.lr=1e-5 (repeatable; values are YAML)")
    p.add_argument("--resume", default=None, metavar="DIR|auto",
                   help="continue from a checkpoint folder, or 'auto': the newest under checkpoint.dir")
    p.add_argument("--overwrite", action="store_true",
                   help="a fresh run into a log.out_dir that holds another run replaces it (log.overwrite=true)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even with settings that differ from the checkpoint's in ways that change what "
                        "the remaining steps compute (checkpoint.allow_config_change=true)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    if cmd == "grpo" and scheduled:
        p.add_argument("--scheduler", default=None, metavar="ADDR",
                       help="run under an `rlcu sched serve` scheduler (unix:PATH, 127.0.0.1:PORT or ray:NAME)")
        p.add_argument("--job-name", default=None, help="the job's name at the scheduler (default: derived)")
    p.add_argument("-h", "--help", action="store_true", help="show this help, with every option and its default")
    return p


def _load(cmd: str):
    import importlib

    cmod, ccls, tmod, tcls, _ = COMMANDS[cmd]
    return getattr(importlib.import_module(cmod), ccls), (tmod, tcls)


def main(argv: list[str] | None = None, scheduled=None) -> int:
    """The command line of `argv` ([sft|grpo|ppo, ...]) -> its exit status. `scheduled(prog, cfg,
    addr, job_name) -> status` runs a GRPO job under a scheduler: given, `rlcu grpo` takes
    --scheduler ADDR and --job-name (the `rlcu` command hands in rlcu.sched.job's; the trainers
    import nothing of the scheduler, which sits above them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        got = argv[0] if argv else "nothing"
        print(f"rlcu.train.cli: the first argument must be one of {', '.join(COMMANDS)}, got {got!r}", file=sys.stderr)
        return 2
    cmd = argv[0]
    p = _parser(cmd, scheduled is not None)
    args = p.parse_args(argv[1:])
    from rlcu.config import ConfigError, command_config, config_to_dict
    from rlcu.parallel.comm import print_once

    cls, (tmod, tcls) = _load(cmd)
    files = args.config if isinstance(args.config, list) else [args.config]
    args.config = files[0] if files else None
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.overwrite:
        overrides.append("log.overwrite=true")
    if args.allow_config_change:
        overrides.append("checkpoint.allow_config_change=true")
    if len(files) > 1:
        return _host_main(cmd, p, args, files, overrides, scheduled)
    cfg = command_config(cls, p, args, overrides, say=print_once)  # under torchrun: once, not once a rank
    if isinstance(cfg, int):
        return cfg
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    from rlcu.rewards import add_import_dir

    add_import_dir(args.config)  # a reward module beside the config imports without PYTHONPATH
    from rlcu.threads import apply

    apply(cfg.model.threads)  # before any work: torch's default counts every core of the machine
    if getattr(args, "scheduler", None):  # under torchrun: one job, its leases span the ranks' devices
        return scheduled(f"rlcu {cmd}", cfg, args.scheduler, args.job_name, [args.config])
    import importlib

    trainer_cls = getattr(importlib.import_module(tmod), tcls)
    try:
        trainer = trainer_cls(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print_once(f"rlcu {cmd}: {e}")
        return 2
    from rlcu.train.core import exit_status

    return exit_status(f"rlcu {cmd}", trainer.train)


def _host_main(cmd: str, p, args, files: list[str], overrides: list[str], scheduled) -> int:
    """`rlcu grpo a.yaml b.yaml ...`: the configs as jobs of one LoRA host (rlcu.train.lora_host);
    the exit status is the worst of the jobs' (each job's the one it gives alone), 2 when the
    configs cannot share a host (one line naming the file and the field). With --scheduler the
    host is one job of that scheduler (`scheduled(prog, configs, addr, name, files)`)."""
    from rlcu.config import ConfigError, GRPOConfig, command_config, config_to_dict

    cfgs = []
    for f in files:
        args.config = f
        cfg = command_config(GRPOConfig, p, args, overrides)
        if isinstance(cfg, int):
            return cfg
        cfgs.append(cfg)
    if args.print_config:
        import yaml

        for f, cfg in zip(files, cfgs):
            print(f"# {f}\n" + yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    from rlcu.rewards import add_import_dir
    from rlcu.threads import apply

    for f in files:
        add_import_dir(f)
    apply(cfgs[0].model.threads)
    if getattr(args, "scheduler", None):  # the host as one job of the scheduler (rlcu.sched.host)
        return scheduled(f"rlcu {cmd}", cfgs, args.scheduler, args.job_name, files)
    from rlcu.train.lora_host import LoraHost

    try:
        host = LoraHost(cfgs, sources=files)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"rlcu {cmd}: {e}", file=sys.stderr)
        return 2
    host.train()
    return host.status


if __name__ == "__main__":
    sys.exit(main())
