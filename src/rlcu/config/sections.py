"""The sections a run's config is made of: model, data, optim, checkpoint, log, engine, and
`RunConfig`, the six that every trainer's config begins with (lora's section is config/lora.py's;
SFT, GRPO and PPO each add
their own fields after them, so every run's YAML opens the same way)."""

from __future__ import annotations

import dataclasses

from rlcu.config.fields import ConfigError, Section, opt
from rlcu.config.lora import LoraSection
from rlcu.model.config import checkpointed_layers

GPU_MEMORY_UTILIZATION = 0.6  # the engine's default (LLM and engine.gpu_memory_utilization: null)


CHECKPOINTING_MODES = ("full", "attention", "none", "auto")


@dataclasses.dataclass
class ModelConfig(Section):
    path: str | None = opt(None, "HF folder of a Qwen3, Qwen2/2.5, Llama 3.x or Mistral checkpoint (config.json + "
                                 "safetensors; docs/models.md), or its Hugging Face Hub id (e.g. Qwen/Qwen3-0.6B, "
                                 "fetched into the Hub's cache; ID@revision pins "
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
class RunConfig(Section):
    """The sections every trainer's config begins with; rlcu.train.core.Trainer reads these."""

    model: ModelConfig = opt(ModelConfig, "the model (GRPO/PPO: the policy, and with a KL term its frozen "
                                          "reference copy)")
    data: DataConfig = opt(DataConfig, "the data (GRPO/PPO: the prompts; fields other than the prompt reach the "
                                       "reward functions)")
    optim: OptimConfig = opt(OptimConfig, "the optimizer and learning-rate schedule (GRPO/PPO: the policy's)")
    checkpoint: CheckpointConfig = opt(CheckpointConfig, "checkpoints and resume")
    log: LogConfig = opt(LogConfig, "logging")
    lora: LoraSection = opt(LoraSection, "LoRA adapters over a frozen base (off unless lora.r or lora.path is set; "
                                         "docs/models.md)")
