"""Where an unknown config key may belong, for the error that refuses it.

Two kinds of hint, tried in this order:

- TRL's name of one of our options (`learning_rate` is `optim.lr` here, `num_generations` is
  `group_size`, `beta` is `kl_coef`...): a config written for TRL's GRPOTrainer, or a habit
  from it, gets our name at once. A TRL name is hinted only where the config being loaded has
  the option (SFT has no `kl_coef`); its meaning may differ in detail (TRL's `loss_type`
  values are not our `loss_agg` values), which the option's help then says.
- the exact name of an option below the section (`lr` at the top -> `optim.lr`), else a near
  miss (difflib): first among the section's own options (`optim.lrr` -> `optim.lr`), then among
  every option below it by its last name (`warmup` -> `optim.warmup_steps`).

Paths are dotted and relative to the section the key was found in.
"""

from __future__ import annotations

import difflib

# TRL's (and transformers' TrainingArguments') name -> ours
TRL_NAMES = {
    "learning_rate": "optim.lr",
    "lr_scheduler_type": "optim.schedule",
    "adam_beta1": "optim.betas",
    "adam_beta2": "optim.betas",
    "adam_epsilon": "optim.eps",
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "response_length": "max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "max_steps": "steps",
    "beta": "kl_coef",
    "epsilon": "clip_low",
    "cliprange": "clip_low",
    "epsilon_high": "clip_high",
    "cliprange_value": "critic.value_clip",
    "num_iterations": "mu",
    "num_ppo_epochs": "mu",
    "loss_type": "loss_agg",
    "mask_truncated_completions": "overlong",
    "reward_funcs": "rewards",
    "reward_weights": "rewards",
    "gradient_accumulation_steps": "grad_accum",
    "max_length": "max_seq_len",
    "max_seq_length": "max_seq_len",
    "model_name_or_path": "model.path",
    "bf16": "model.dtype",
    "output_dir": "log.out_dir",
    "logging_steps": "log.every",
    "report_to": "log.wandb",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "checkpoint.resume",
    "eval_steps": "eval_every",
    "vllm_gpu_memory_utilization": "engine.gpu_memory_utilization",
    "lora_r": "lora.r",  # TRL's ModelConfig (use_peft)
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules",
    "use_rslora": "lora.rslora",
}


def hint(key: str, names: list[str], leaves: list[str]) -> tuple[str, str] | None:
    """('trl', path) or ('near', path) for an unknown `key` of a section whose own options are
    `names` and whose options at every depth are `leaves` (dotted, shallowest first); None
    when nothing is close."""
    trl = TRL_NAMES.get(key)
    if trl is not None:
        for path in (trl, trl.rsplit(".", 1)[-1]):  # at the top, or inside the section it names
            if path in leaves:
                return "trl", path
        return None  # TRL's option, with no counterpart in this config: no guess
    by_last: dict[str, str] = {}
    for path in leaves:
        by_last.setdefault(path.rsplit(".", 1)[-1], path)  # the shallowest of a name
    if key in by_last:  # the very name of a deeper option (`lr` -> optim.lr) beats a near miss (`lora`)
        return "near", by_last[key]
    near = difflib.get_close_matches(key, names, n=1)
    if near:
        return "near", near[0]
    near = difflib.get_close_matches(key, list(by_last), n=1)
    return ("near", by_last[near[0]]) if near else None


def hint_text(key: str, found: tuple[str, str] | None, parent: str) -> str:
    """The hint as the error's clause; `parent`: the dotted path of the section (may be '')."""
    if found is None:
        return ""
    kind, path = found
    full = f"{parent}.{path}" if parent else path
    if kind == "trl":
        return f"; TRL's {key!r} is rlcu's {full!r}"
    return f"; did you mean {full!r}?"
