"""Run configuration: plain dataclasses, YAML files and `--set a.b=c` overrides.

Every option is a dataclass field made with `opt(default, help, ...)`: the help string,
the allowed values (`choices`) and numeric bounds (`gt`, `ge`, `lt`, `le`) live in the
field's metadata, so that one generic `__post_init__` coerces and checks every field and
`config_help` lists every option with its default. Sections nest (a field whose type is a
`Section` takes a section instance or a plain dict), and errors carry the dotted path of
the offending field, e.g. `optim.lr must be > 0, got -1 (in run.yaml)`.

YAML scalars are parsed by PyYAML (YAML 1.1), which reads `1e-4` as a string: float fields
accept such strings. Trainer-specific RL sections (GRPO, PPO, the critic) live in
rlcu/train/rl_config.py and are built from the sections defined here.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlcu.config_hints import hint, hint_text
from rlcu.model.config import checkpointed_layers

_MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A bad config value. `path` is the dotted field path, `detail` the complaint."""

    def __init__(self, path: str, detail: str, source: str | None = None):
        self.path, self.detail, self.source = path, detail, source
        super().__init__(str(self))

    def __str__(self) -> str:
        s = f"{self.path} {self.detail}" if self.path else self.detail
        return s + (f" (in {self.source})" if self.source else "")

    def under(self, prefix: str, source: str | None = None) -> ConfigError:
        path = f"{prefix}.{self.path}" if prefix and self.path else (prefix or self.path)
        return ConfigError(path, self.detail, self.source or source)


def opt(default: Any = _MISSING, help: str = "", *, choices: tuple | None = None, gt=None, ge=None,
        lt=None, le=None):
    """A documented config field. Mutable defaults (dict, list, a Section class) are
    wrapped in a default_factory."""
    md = dict(help=help, choices=choices, gt=gt, ge=ge, lt=lt, le=le)
    if isinstance(default, type) and issubclass(default, Section):
        return dataclasses.field(default_factory=default, metadata=md)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda d=default: _copy(d), metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _copy(x):
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x


# ---------------------------------------------------------------- type coercion
def _hints(cls) -> dict[str, Any]:
    mod = sys.modules.get(cls.__module__)
    return typing.get_type_hints(cls, globalns=vars(mod) if mod else None)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp) -> str:
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    o = typing.get_origin(tp)
    if o is not None:
        return getattr(o, "__name__", str(o))
    return getattr(tp, "__name__", str(tp))


def _coerce(val, tp, name: str):
    """Return `val` converted to type `tp` or raise ConfigError(name, ...)."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if val is None and type(None) in args:
            return None
        errs = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(val, a, name)
            except ConfigError as e:
                errs.append(e)
        raise ConfigError(name, f"must be {_type_name(tp)}, got {val!r}")
    if tp is Any:
        return val
    if isinstance(tp, type) and issubclass(tp, Section):
        if isinstance(val, tp):
            return val
        if isinstance(val, dict):
            return _build(tp, val, name)
        raise ConfigError(name, f"must be a mapping of {tp.__name__} options, got {val!r}")
    if tp is bool:
        if isinstance(val, bool):
            return val
        if isinstance(val, str) and val.lower() in ("true", "false", "yes", "no", "on", "off"):
            return val.lower() in ("true", "yes", "on")
        raise ConfigError(name, f"must be true or false, got {val!r}")
    if tp is int:
        if isinstance(val, int) and not isinstance(val, bool):
            return val
        if isinstance(val, float) and val.is_integer():
            return int(val)
        if isinstance(val, str):
            try:
                return int(val)
            except ValueError:
                pass
        raise ConfigError(name, f"must be an integer, got {val!r}")
    if tp is float:
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return float(val)
        if isinstance(val, str):
            try:
                return float(val)
            except ValueError:
                pass
        raise ConfigError(name, f"must be a number, got {val!r}")
    if tp is str:
        if isinstance(val, str):
            return val
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return str(val)
        raise ConfigError(name, f"must be a string, got {val!r}")
    o, args = typing.get_origin(tp), typing.get_args(tp)
    if o is tuple:
        if not isinstance(val, (list, tuple)):
            raise ConfigError(name, f"must be a list of {len(args)} values, got {val!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(val))
        if len(val) != len(args):
            raise ConfigError(name, f"must have {len(args)} values, got {len(val)}: {list(val)!r}")
        return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(val, args)))
    if o is list or tp is list:
        if not isinstance(val, (list, tuple)):
            raise ConfigError(name, f"must be a list, got {val!r}")
        a = args[0] if args else Any
        return [_coerce(v, a, f"{name}[{i}]") for i, v in enumerate(val)]
    if o is dict or tp is dict:
        if not isinstance(val, dict):
            raise ConfigError(name, f"must be a mapping, got {val!r}")
        return dict(val)
    if isinstance(tp, type) and isinstance(val, tp):
        return val
    raise ConfigError(name, f"must be {_type_name(tp)}, got {val!r}")


def _check_bounds(val, md: dict, name: str) -> None:
    ch = md.get("choices")
    if ch is not None and val not in ch:
        raise ConfigError(name, f"must be one of {', '.join(repr(c) for c in ch)}; got {val!r}")
    if val is None or isinstance(val, bool) or not isinstance(val, (int, float)):
        return
    for key, ok, word in (("gt", lambda a, b: a > b, ">"), ("ge", lambda a, b: a >= b, ">="),
                          ("lt", lambda a, b: a < b, "<"), ("le", lambda a, b: a <= b, "<=")):
        b = md.get(key)
        if b is not None and not ok(val, b):
            raise ConfigError(name, f"must be {word} {b}, got {val!r}")


class Section:
    """Base of every config section: coerces and checks each field after __init__,
    then runs the section's own cross-field `check()`."""

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            val = _coerce(getattr(self, f.name), hints[f.name], f.name)
            if isinstance(val, tuple) and f.metadata.get("choices") is None:
                for i, v in enumerate(val):
                    _check_bounds(v, f.metadata, f"{f.name}[{i}]")
            else:
                _check_bounds(val, f.metadata, f.name)
            object.__setattr__(self, f.name, val)
        self.check()

    def check(self) -> None:
        """Cross-field validation; raise ConfigError(field, detail)."""


def _build(cls, data: dict, prefix: str = "", source: str | None = None):
    """cls(**data) with unknown keys and bad values reported under `prefix`."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {data!r}", source)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            raise _unknown(k, cls, prefix, source)
    try:
        return cls(**data)
    except ConfigError as e:
        raise e.under(prefix, source) from None


class UnknownOption(ConfigError):
    """A key that is no option of its section: `parent` is the section's dotted path, `found`
    where the key may belong (rlcu.config_hints: TRL's name of ours, or a near miss)."""

    def __init__(self, parent: str, key, names: list[str], found, source: str | None = None):
        self.parent, self.key, self.names, self.found = parent, key, list(names), found
        where = f"{parent}.{key}" if parent else str(key)
        super().__init__("", f"unknown option {where!r}{hint_text(str(key), found, parent)} "
                             f"(known: {', '.join(self.names)})", source)

    def under(self, prefix: str, source: str | None = None) -> ConfigError:
        parent = f"{prefix}.{self.parent}" if prefix and self.parent else (prefix or self.parent)
        return UnknownOption(parent, self.key, self.names, self.found, self.source or source)


def _unknown(key, cls, prefix, source) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    return UnknownOption(prefix, key, names, hint(str(key), names, _leaf_paths(cls)), source)


def _leaf_paths(cls) -> list[str]:
    """The dotted path of every option below `cls` that is not a section, shallowest first."""
    out, todo = [], [(cls, "")]
    while todo:
        c, prefix = todo.pop(0)
        for f in dataclasses.fields(c):
            tp = _hints(c)[f.name]
            if isinstance(tp, type) and issubclass(tp, Section):
                todo.append((tp, f"{prefix}{f.name}."))
            else:
                out.append(prefix + f.name)
    return out


# ---------------------------------------------------------------- sections
GPU_MEMORY_UTILIZATION = 0.6  # the engine's default (LLM and engine.gpu_memory_utilization: null)


CHECKPOINTING_MODES = ("full", "attention", "none", "auto")


@dataclasses.dataclass
class ModelConfig(Section):
    path: str | None = opt(None, "HF folder of a Qwen3 checkpoint (config.json + safetensors), or its Hugging Face "
                                 "Hub id (e.g. Qwen/Qwen3-0.6B, fetched into the Hub's cache; ID@revision pins "
                                 "one); null with `tiny` for a model made from scratch")
    revision: str | None = opt(None, "the Hub revision (branch, tag or commit) of a model.path that is a Hub id "
                                     "(and of its tokenizer); null: main")
    tiny: dict | None = opt(None, "Qwen3Config fields of a model initialised from scratch "
                                  "(e.g. {vocab_size: 64, hidden_size: 64, ...}); used when path is null")
    tokenizer: str | None = opt(None, "tokenizer folder, tokenizer.json or Hub id; null: the model's")
    dtype: str = opt("auto", "working precision of the weights; auto: bfloat16 on CUDA, float32 on the CPU",
                     choices=("auto", "float32", "bfloat16"))
    device: str = opt("auto", "where the model runs; auto: cuda when available, else cpu",
                      choices=("auto", "cpu", "cuda"))
    gradient_checkpointing: bool | int | str = opt(
        True, "true / 'full': keep only each layer's input and recompute the layer in the backward (same "
              "gradients, less memory); 'attention': also keep attention's output (the recompute skips it); "
              "false / 'none': keep every activation (fastest, most memory); an int k: checkpoint k layers, "
              "keep everything of the others; 'auto': the fewest checkpointed layers whose estimated peak fits "
              "the GPU (decided at the first update)")
    init_seed: int = opt(0, "seed of the random initialisation of a `tiny` model", ge=0)
    threads: int | str = opt("auto", "torch CPU threads of each process; auto: $OMP_NUM_THREADS when set, else the "
                                     "cores this process may use (CPU affinity, cgroup quota, a scheduled job's CPU "
                                     "slots), at most those idle at the start, divided among the node's ranks. A CPU "
                                     "run records the count it used and resumes on it under auto", ge=1)

    def check(self):
        if isinstance(self.threads, str) and self.threads != "auto":
            raise ConfigError("threads", f"must be 'auto' or a number of threads >= 1, got {self.threads!r}")
        gc = self.gradient_checkpointing
        if isinstance(gc, str) and gc not in CHECKPOINTING_MODES:
            raise ConfigError("gradient_checkpointing", f"must be true, false, a number of layers or one of "
                                                        f"{', '.join(map(repr, CHECKPOINTING_MODES))}; got {gc!r}")
        if (checkpointed_layers(gc) or 0) < 0:
            raise ConfigError("gradient_checkpointing", f"as a number of checkpointed layers must be >= 0, got {gc}")
        if self.path is not None and self.tiny is not None:
            raise ConfigError("tiny", "must be null when path is set (give one of model.path, model.tiny)")

    def check_layers(self, num_layers: int) -> None:
        """A number of checkpointed layers against the model's layer count (known once the
        model's config is read)."""
        k = checkpointed_layers(self.gradient_checkpointing)
        if k is not None and k > num_layers:
            raise ConfigError("model.gradient_checkpointing", f"checkpoints {k} layers; the model has {num_layers}")

    def resolve_device(self) -> str:
        if self.device != "auto":
            return check_device(self.device, "model.device")
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolve_device() == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


def check_device(device, field: str) -> str:
    """`device` (cpu, cuda or cuda:N) when this machine has it, else a ConfigError naming
    `field` (torch's own error is a long traceback ending in 'Torch not compiled with CUDA')."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ConfigError(field, f"must be cpu, cuda or cuda:N, got {device!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(field, f"is {device!r}, but {why} (torch {torch.__version__}): use cpu")
    if d.type == "cuda" and d.index is not None and d.index >= (n := torch.cuda.device_count()):
        raise ConfigError(field, f"is {device!r}, but this machine has {n} CUDA device(s): cuda:0 to cuda:{n - 1}")
    return str(device)


@dataclasses.dataclass
class DataConfig(Section):
    path: str | None = opt(None, "training data: a .jsonl, .json or .parquet file (one example per row), a dataset "
                                 "folder, or a Hugging Face Hub dataset id (e.g. trl-lib/Capybara; ID@revision "
                                 "pins one); folders and Hub ids are read by `datasets` (pip install "
                                 "'rlcu[datasets]')")
    split: str = opt("train", "the split of data.path when it is a dataset folder or Hub id (datasets' syntax, "
                              "e.g. train or train[:1000])")
    subset: str | None = opt(None, "the configuration of a Hub dataset with several (load_dataset's name, e.g. "
                                   "main for openai/gsm8k); null: its only or default one")
    prompt_field: str = opt("prompt", "row field holding the prompt (a string or chat messages)")
    completion_field: str = opt("completion", "row field holding the SFT target completion "
                                              "(rows may instead hold chat `messages`)")
    messages_field: str = opt("messages", "row field holding a chat conversation for SFT; the "
                                          "assistant turns are the completion")
    chat_template_kwargs: dict = opt({}, "variables of the chat template where chat messages are rendered (SFT "
                                         "and RL prompts, evaluation), as TRL's and `rlcu generate "
                                         "--chat-template-kwargs`: e.g. {enable_thinking: false} for Qwen3")
    max_prompt_tokens: int | None = opt(None, "GRPO/PPO: the most tokens a prompt may have; null: what the model's "
                                              "context leaves after max_new_tokens (checked at load either way)",
                                        gt=0)
    overlong_prompts: str = opt("drop", "GRPO/PPO: prompts over the limit (max_prompt_tokens, or the context less "
                                        "max_new_tokens): drop (counted, with their rows in the log) or error "
                                        "(stop before training, naming them)", choices=("drop", "error"))
    shuffle: bool = opt(True, "shuffle the rows every epoch (seeded, so resumable)")
    seed: int = opt(0, "seed of the data order", ge=0)
    eval_path: str | None = opt(None, "held-out data: a file, dataset folder or Hub dataset id as for path; null: "
                                      "split eval_size rows off the training data")
    eval_split: str = opt("test", "the split of eval_path when it is a dataset folder or Hub id")
    eval_size: int = opt(0, "rows held out for evaluation when eval_path is null (0: none)", ge=0)


@dataclasses.dataclass
class OptimConfig(Section):
    lr: float = opt(1e-5, "peak learning rate (after warmup)", gt=0)
    betas: tuple[float, float] = opt((0.9, 0.999), "AdamW beta1, beta2", ge=0.0, lt=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0)
    weight_decay: float = opt(0.0, "decoupled weight decay (AdamW)", ge=0)
    max_grad_norm: float = opt(1.0, "clip the global gradient norm to this; 0 disables clipping", ge=0)
    schedule: str = opt("constant", "learning-rate schedule after warmup", choices=("constant", "cosine"))
    warmup_steps: int = opt(0, "linear warmup steps from lr/warmup_steps to lr", ge=0)
    min_lr_ratio: float = opt(0.0, "cosine: the final lr as a fraction of lr", ge=0, le=1)
    max_nonfinite_in_row: int = opt(5, "abort (after checkpointing the last good state) when this many "
                                       "steps in a row have a non-finite loss or gradient norm", ge=1)
    master_weights: bool = opt(True, "keep an fp32 master copy of bf16 weights (4 bytes a parameter); false: "
                                     "update the bf16 weights in place, written back with stochastic rounding "
                                     "(no effect on fp32 weights)")
    state_dtype: str = opt("float32", "storage of the Adam moments m, v (the math is fp32 either way); "
                                      "bfloat16 halves them, written with stochastic rounding",
                           choices=("float32", "bfloat16"))
    rounding_seed: int = opt(0, "seed of the stochastic rounding (with the step and the element index: "
                                "deterministic, and exact across resume)", ge=0)
    grad_dtype: str = opt("float32", "the gradient buffer of bf16 weights: float32, or bfloat16 (half the bytes; "
                                     "each micro-batch's gradient is rounded once into the sum, as torch autograd "
                                     "does for bf16 parameters); fp32 weights keep fp32 gradients",
                          choices=("float32", "bfloat16"))
    release_grads: bool = opt(True, "RL trainers: free the gradient buffer after each step's updates, so "
                                    "that the rollout phase does not hold it (the next backward reallocates it)")


@dataclasses.dataclass
class CheckpointConfig(Section):
    dir: str | None = opt(None, "checkpoint root (step-000123/ folders); null: <log.out_dir>/checkpoints")
    every: int = opt(0, "save every N steps (0: only at the end)", ge=0)
    keep_last: int = opt(2, "keep the newest K checkpoints (0: keep all)", ge=0)
    resume: str | None = opt(None, "null: start fresh; 'auto': the newest checkpoint under dir if any; "
                                   "or a checkpoint folder")
    save_at_end: bool = opt(True, "save a checkpoint after the last step")
    allow_config_change: bool = opt(False, "resume even when settings that change what the remaining steps "
                                           "compute (lr, batch and group sizes, seeds, data, model...) differ "
                                           "from the checkpoint's (the changes are listed in the log either way)")


@dataclasses.dataclass
class LogConfig(Section):
    out_dir: str = opt("runs/rlcu", "run folder: metrics.jsonl, TensorBoard events, plots, log.txt; a fresh run "
                                    "refuses a folder that holds another run unless overwrite")
    overwrite: bool = opt(False, "a fresh run into a log.out_dir that holds another run first removes that run's "
                                 "files and checkpoints (else it is refused; resume it with checkpoint.resume)")
    every: int = opt(1, "write metrics every N steps", ge=1)
    tensorboard: bool = opt(True, "write a TensorBoard event file (scalars; needs the tensorboard package: "
                                  "pip install 'rlcu[tensorboard]', else a warning)")
    plot: bool = opt(True, "write a PNG of the curves at the end: reward_curve.png, or loss_curve.png when "
                           "there is no reward (needs matplotlib)")
    progress: bool = opt(True, "show a progress bar on a terminal (else, and when not a terminal: one line "
                               "per logged step)")
    plot_keys: list[str] | None = opt(None, "metrics drawn in the PNG; null: the reward (the total and each "
                                            "function's), else the loss, each with its held-out curve (eval/...)")
    wandb: bool = opt(False, "log to Weights & Biases (pip install 'rlcu[wandb]'; WANDB_MODE=offline needs no "
                             "account); a resumed run continues the W&B run whose id is in out_dir/wandb_run_id")
    wandb_project: str = opt("rlcu", "W&B project")
    wandb_entity: str | None = opt(None, "W&B entity (user or team); null: the account's default")
    wandb_name: str | None = opt(None, "W&B run name; null: the name of out_dir")


@dataclasses.dataclass
class EngineConfig(Section):
    max_num_seqs: int = opt(256, "most sequences decoded at once", ge=1)
    max_num_batched_tokens: int = opt(8192, "token budget of one engine step (prefill chunking)", ge=1)
    gpu_memory_utilization: float | None = opt(
        None, "fraction of the device's total memory this process may use once the KV pool is allocated "
              "(weights, trainer state, activations and the pool together, as in vLLM); sizes the pool when "
              f"num_kv_blocks is null. null: {GPU_MEMORY_UTILIZATION} for the engine alone; GRPO/PPO size the "
              "pool to one step's sequences instead (set it to size the pool from memory)", gt=0, le=1)
    block_size: int = opt(16, "tokens per KV-cache block", ge=1)
    num_kv_blocks: int | None = opt(None, "KV-cache blocks; null: GRPO/PPO hold one step's (or one "
                                          "evaluation's) sequences unless gpu_memory_utilization is set, which "
                                          "then sizes the pool (on the CPU the engine holds 4 longest sequences)",
                                    ge=1)
    enforce_eager: bool = opt(False, "never capture CUDA graphs")
    prefill_graphs: bool = opt(True, "run prefill and mixed steps by CUDA graphs too (their pool holds about one "
                                     "full-budget step's activations while the engine is awake)")


@dataclasses.dataclass
class SFTConfig(Section):
    model: ModelConfig = opt(ModelConfig, "the model")
    data: DataConfig = opt(DataConfig, "the data")
    optim: OptimConfig = opt(OptimConfig, "the optimizer and learning-rate schedule")
    checkpoint: CheckpointConfig = opt(CheckpointConfig, "checkpoints and resume")
    log: LogConfig = opt(LogConfig, "logging")
    steps: int = opt(100, "optimizer steps", ge=1)
    batch_tokens: int = opt(4096, "tokens per packed micro-batch (an example longer than this gets a "
                                  "micro-batch of its own)", ge=1)
    grad_accum: int = opt(1, "micro-batches per optimizer step (gradient accumulation)", ge=1)
    cuda_graph: bool = opt(False, "replay each step as CUDA graphs (micro-batch forward + backward padded to "
                                  "batch_tokens, and the optimizer step), captured at the first step; eager, "
                                  "with the reason logged, on the CPU, in exact mode, with several ranks or "
                                  "bf16 gradients, and for a micro-batch past batch_tokens. Pays where "
                                  "launches, not the GPU, bound the step: small micro-batches and the PPO "
                                  "critic (bench/results/train_graph.json). Off by default: past ~8k tokens "
                                  "a micro-batch gains little, every micro-batch is padded to batch_tokens, "
                                  "and the first step captures (~1 s); turn it on for small micro-batches")
    max_seq_len: int = opt(1024, "drop examples longer than this many tokens (the count is logged)", ge=2)
    eval_every: int = opt(0, "held-out loss (data.eval_path or data.eval_size) every N steps; 0: at the end only",
                          ge=0)
    seed: int = opt(0, "global seed", ge=0)


# ---------------------------------------------------------------- loading / help
def _set_path(data: dict, cls, dotted: str, value, source: str) -> None:
    """data[a][b] = value for dotted 'a.b', walking the fields of `cls` (unknown keys error;
    inside a dict-typed field any key is accepted)."""
    keys = dotted.split(".")
    d, c, prefix = data, cls, ""
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        if c is not None:
            names = {f.name: f for f in dataclasses.fields(c)}
            if k not in names:
                raise _unknown(k, c, prefix, source)
            tp = _hints(c)[k]
            sub = [a for a in ((tp,) if not _is_union(tp) else typing.get_args(tp))
                   if isinstance(a, type) and issubclass(a, Section)]
            nxt = sub[0] if sub else None
        else:
            nxt = None
        if last:
            d[k] = value
            return
        if not isinstance(d.get(k), dict):
            if c is not None and nxt is None and not _is_dict_type(_hints(c)[k]):
                raise ConfigError(f"{prefix}.{k}" if prefix else k, "is not a section; cannot set "
                                  f"{dotted!r}", source)
            d[k] = {}
        d, c, prefix = d[k], nxt, f"{prefix}.{k}" if prefix else k


def _is_dict_type(tp) -> bool:
    args = typing.get_args(tp) if _is_union(tp) else (tp,)
    return any(a is dict or typing.get_origin(a) is dict for a in args)


def parse_override(s: str) -> tuple[str, Any]:
    """'a.b=c' -> ('a.b', yaml-parsed c)."""
    if "=" not in s:
        raise ConfigError("", f"override {s!r} must look like key.path=value")
    k, v = s.split("=", 1)
    k = k.strip()
    if not k:
        raise ConfigError("", f"override {s!r} has an empty key")
    try:
        val = yaml.safe_load(v) if v.strip() else None
    except yaml.YAMLError:
        val = v
    return k, val


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None):
    """Build `cls` from a YAML file (or nothing: the defaults) plus `--set key.path=value`
    overrides (values parsed as YAML). Unknown keys and bad values raise ConfigError naming
    the dotted key and where it came from."""
    data: dict = {}
    src = None
    if path is not None:
        src = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} not found") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError("", f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError("", f"{path}: the top level must be a mapping of options, got {type(data).__name__}")
    for s in overrides or []:
        k, v = parse_override(s)
        _set_path(data, cls, k, v, f"--set {s}")
    try:
        return _build(cls, data, "")
    except ConfigError as e:
        # name where the bad value came from: the override that set it, else the file
        for s in reversed(overrides or []):
            k = s.split("=", 1)[0].strip()
            if e.path == k or e.path.startswith(k + ".") or e.path.startswith(k + "["):
                raise ConfigError(e.path, e.detail, f"--set {s}") from None
        raise ConfigError(e.path, e.detail, e.source or src) from None


def config_from_dict(cls, data: dict, source: str | None = None):
    """cls built from plain data (e.g. parsed YAML), with the same checks and errors as load_config."""
    return _build(cls, data, "", source)


def config_to_dict(cfg) -> dict:
    """The config as plain YAML-able data (tuples become lists)."""
    def conv(x):
        if isinstance(x, Section):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x
    return conv(cfg)


def save_config(cfg, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _default_repr(f) -> str:
    if f.default is not _MISSING:
        d = f.default
    elif f.default_factory is not _MISSING:
        d = f.default_factory()
        if isinstance(d, Section):
            return ""
    else:
        return "(required)"
    if isinstance(d, tuple):
        d = list(d)
    return yaml.safe_dump(d, default_flow_style=True).strip().removesuffix("...").strip()


def config_help(cls) -> str:
    """Every option of `cls` as 'dotted.name = default  help [choices]', sections first-level
    headed by their help."""
    lines: list[str] = []

    def walk(c, prefix: str):
        hints = _hints(c)
        leaf, subs = [], []
        for f in dataclasses.fields(c):
            tp = hints[f.name]
            if isinstance(tp, type) and issubclass(tp, Section):
                subs.append((f, tp))
            else:
                leaf.append(f)
        for f in leaf:
            name = f"{prefix}{f.name}"
            md = f.metadata
            extra = []
            if md.get("choices"):
                extra.append("one of: " + ", ".join(str(x) for x in md["choices"]))
            for key, word in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                if md.get(key) is not None:
                    extra.append(f"{word} {md[key]}")
            doc = md.get("help", "") + (f" [{'; '.join(extra)}]" if extra else "")
            lines.append(f"  {name} = {_default_repr(f)}")
            lines.append(f"      {doc}")
        for f, tp in subs:
            lines.append(f"{prefix}{f.name}: {f.metadata.get('help', '')}")
            walk(tp, f"{prefix}{f.name}.")

    lines.append(f"{cls.__name__} options (YAML keys; override with --set key=value):")
    walk(cls, "")
    return "\n".join(lines)
