"""RL run configuration: GRPO and PPO (with its critic), either over single completions or over
multi-turn episodes (multi_turn), the run's sections (RunConfig: model, data, optim, checkpoint,
log) plus the engine, the rewards, the rollout and the policy loss.
Every field is documented; the YAML keys are the field names and `--set a.b=c` reaches any of
them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlcu.config.fields import ConfigError, Section, opt
from rlcu.config.sections import EngineConfig, OptimConfig, RunConfig
from rlcu.config_hints import hint, hint_text
from rlcu.hub import hub_id
from rlcu.rewards.model_reward import SPEC_KEYS, ModelRewardError, check_folder, check_spec

_REWARD_KEYS = ("name", "fn", "weight", "kwargs")  # a function's; a reward model's: model_reward.SPEC_KEYS


@dataclasses.dataclass
class MultiTurnConfig(Section):
    """Episodes instead of single completions (docs/tools.md): on when an environment or a tool is set."""

    environment: str | None = opt(None, "an environment class 'module.path:Class', made once per episode: reset(row) "
                                        "(the first observation), tool methods, step(messages), reward(messages), "
                                        "done (docs/tools.md)")
    tools: list[str] = opt([], "tool functions 'module.path:function' beside the environment's tool methods "
                               "(rlcu.tools:python: the built-in sandboxed Python tool)")
    max_turns: int = opt(4, "most model turns per episode", ge=1)
    max_episode_tokens: int = opt(1024, "most tokens of an episode after its prompt, the model's and the "
                                        "environment's (max_new_tokens limits each model turn)", ge=1)
    tool_timeout_s: float = opt(30.0, "most seconds one tool call may take; a late call is an error message to "
                                      "the model (its thread is abandoned: use a subprocess tool for code that may "
                                      "hang)", gt=0)
    tool_workers: int = opt(32, "episodes whose turns (tool calls, step) may run at once", ge=1)

    @property
    def enabled(self) -> bool:
        return self.environment is not None or bool(self.tools)

    def check(self):
        if self.environment is not None and ":" not in self.environment:
            raise ConfigError("environment", f"must be 'module.path:Class', got {self.environment!r}")
        for i, t in enumerate(self.tools):
            if ":" not in t:
                raise ConfigError(f"tools[{i}]", f"must be 'module.path:function', got {t!r}")


@dataclasses.dataclass
class MoeConfig(Section):
    """A Qwen3-MoE policy's routing between the rollout and the trainer (train/moe_routes.py; ignored
    for a dense model)."""

    routing: str = opt("default", "default: the trainer routes each token itself, and every step logs how "
                                  "often its top-k experts differ from the rollout engine's (moe/route_mismatch); "
                                  "replay: the trainer takes the rollout's experts (the weights from its own "
                                  "router's logits over them, the router's gradient through that choice), as slime "
                                  "and verl's routing replay. In exact mode the two route alike by construction "
                                  "and replay changes nothing", choices=("default", "replay"))


@dataclasses.dataclass
class RLConfig(RunConfig):
    """What GRPO and PPO share: the run's sections, the engine, the rollout (completions or episodes) and the
    policy loss."""

    engine: EngineConfig = opt(EngineConfig, "the rollout engine (shares the policy's weights)")
    rewards: list[dict] = opt([{"name": "math", "weight": 1.0}],
                              "rewards, summed with weights: each {name: math|format} or "
                              "{fn: 'module.path:function'}, plus optional weight (1.0) and kwargs ({}); or a "
                              "reward model {model: FOLDER (an HF *ForSequenceClassification folder of one "
                              "label), weight, batch_size, max_tokens (tokens per scoring forward; "
                              "micro_batch_tokens), offload (auto|true|false: its weights in host memory between "
                              "scorings), kwargs (its chat template's variables)} (docs/rewards.md)")
    reward_timeout_s: float | None = opt(300.0, "most seconds one call of a user reward function may take; a late "
                                                "call fails for its samples (null: no limit)", gt=0)
    reward_workers: str = opt("main", "where user reward functions run under the time limit: main (the trainer's "
                                      "thread, as in TRL; a late call is interrupted by a signal, which stops "
                                      "Python code, not a C extension that never returns), thread (a late call is "
                                      "abandoned) or process (a worker process per function, killed when late; "
                                      "the function must be importable by name)",
                              choices=("main", "thread", "process"))
    reward_max_failed_steps: int = opt(3, "stop the run (exit status 1) when a reward function fails on every "
                                          "sample of this many steps in a row (0: never)", ge=0)
    steps: int = opt(100, "training steps (one rollout batch each)", ge=1)
    prompts_per_step: int = opt(8, "prompts per rollout batch", ge=1)
    group_size: int = opt(8, "completions sampled per prompt (GRPO's G)", ge=1)
    max_new_tokens: int = opt(256, "most tokens generated per completion", ge=1)
    temperature: float = opt(1.0, "sampling temperature of the rollouts (the loss uses the same "
                                  "temperature-scaled distribution)", gt=0)
    top_p: float = opt(1.0, "nucleus sampling of the rollouts", gt=0, le=1)
    top_k: int = opt(-1, "top-k sampling of the rollouts (<= 0: off)")
    stop_at_eos: bool = opt(True, "end a completion at the tokenizer's / model's EOS")
    mu: int = opt(1, "optimizer updates per rollout batch, each over the whole batch, against the same old "
                     "logprobs (old_logprobs)", ge=1)
    old_logprobs: str = opt("engine", "the old policy of the PPO ratio: engine (the engine's sampling logprobs; no "
                                      "extra pass, the ratio carries the engine/trainer mismatch) or recompute (the "
                                      "trainer's forward without gradients before the updates: the first update's "
                                      "ratio is exactly 1 and the engine is the behaviour policy)",
                            choices=("engine", "recompute"))
    behaviour_correction: str = opt("none", "correct for the engine's sampling policy with rho = exp(old_lp - "
                                            "engine_lp) per token (needs old_logprobs: recompute): none; tis "
                                            "(weight min(rho, tis_cap) on the surrogate); mis_token (weight rho, "
                                            "tokens with rho outside [mis_low, mis_high] left out of the loss); "
                                            "mis_seq (the sequence's rho = prod of its tokens', whole sequences "
                                            "left out)", choices=("none", "tis", "mis_token", "mis_seq"))
    tis_cap: float = opt(2.0, "tis: the cap C of the weight min(rho, C)", gt=0)
    mis_low: float = opt(0.5, "mis_token / mis_seq: the lowest ratio kept", ge=0)
    mis_high: float = opt(2.0, "mis_token / mis_seq: the highest ratio kept", gt=0)
    clip_low: float = opt(0.2, "ratio clip below: 1 - clip_low", ge=0, lt=1)
    clip_high: float = opt(0.2, "ratio clip above: 1 + clip_high (DAPO's clip-higher: e.g. 0.28)", ge=0)
    entropy_coef: float = opt(0.0, "entropy bonus: loss -= entropy_coef * entropy", ge=0)
    loss_agg: str = opt("token", "loss aggregation: token (DAPO: mean over all completion tokens of the "
                                 "batch), seq_mean (GRPO: mean per sequence, then over sequences) or "
                                 "seq_mean_token_sum_norm (Dr. GRPO: the sum over all completion tokens divided "
                                 "by a constant, sequences x max_new_tokens; verl's name)",
                        choices=("token", "seq_mean", "seq_mean_token_sum_norm"))
    importance_sampling_level: str = opt("token", "the ratio the loss clips (TRL's name): token (PPO/GRPO: "
                                                  "each token's pi/pi_old); sequence (GSPO: the sequence's "
                                                  "exp(mean over its completion tokens of log pi - log pi_old), "
                                                  "clipped as one); sequence_token (GSPO-token: the sequence's "
                                                  "ratio and clip, each token's own gradient). docs/estimators.md",
                                         choices=("token", "sequence", "sequence_token"))
    overlong: str = opt("none", "completions cut at max_new_tokens: none, mask (no loss), or penalty "
                                "(DAPO's soft penalty over the last overlong_buffer tokens, added to the reward)",
                        choices=("none", "mask", "penalty"))
    overlong_buffer: int = opt(0, "penalty: the last tokens before max_new_tokens over which the penalty "
                                  "falls from 0 to -1 (0: -1 at max_new_tokens only)", ge=0)
    micro_batch_tokens: int = opt(16384, "tokens per forward/backward micro-batch (a longer sequence gets "
                                         "one of its own)", ge=1)
    chat_template: bool = opt(True, "render chat-message prompts with the tokenizer's chat template "
                                    "(string prompts are used as they are)")
    seed: int = opt(0, "seed of sampling (per step, so a resumed run samples the same)", ge=0)
    exact: bool = opt(False, "exact on-policy mode (the trainer sets its models' `exact` from it, a model passed "
                             "in included): the engine's sampling logprobs equal the trainer's forward bit for "
                             "bit, through batch-invariant kernels")
    eval_every: int = opt(0, "evaluate the held-out prompts (greedy) every N steps and after the last (0: only "
                             "after the last; none without held-out prompts): eval/reward, the mean total reward; "
                             "eval/reward/NAME, each function's mean; eval/accuracy, the fraction whose total "
                             "reward is > 0 (with a shaped reward or several, read each function's mean)", ge=0)
    eval_max_prompts: int = opt(256, "held-out prompts used per evaluation", ge=1)
    moe: MoeConfig = opt(MoeConfig, "a Qwen3-MoE policy's routing: the disagreement metric, or routing replay")
    multi_turn: MultiTurnConfig = opt(MultiTurnConfig, "multi-turn episodes with tools or an environment "
                                                       "(off unless multi_turn.environment or tools is set)")

    def sequence_new_tokens(self) -> int:
        """The most tokens a rollout sequence holds after its prompt: an episode's, else a completion's."""
        return self.multi_turn.max_episode_tokens if self.multi_turn.enabled else self.max_new_tokens

    @staticmethod
    def _check_model_reward(i: int, spec: dict) -> None:
        """A reward model's entry: its options, and its folder when it is a path here (a Hub id is
        fetched and checked at setup)."""
        if "fn" in spec:
            raise ConfigError(f"rewards[{i}].fn", f"is not an option of a reward model (allowed: "
                                                  f"{', '.join(SPEC_KEYS)})")
        try:
            check_spec(spec, f"rewards[{i}]")
            m = spec["model"]
            if not isinstance(m, str):
                raise ModelRewardError(f"rewards[{i}].model", f"must be a folder, got {m!r}")
            if Path(m).expanduser().exists() or hub_id(m) is None:
                check_folder(m, f"rewards[{i}].model")
        except ModelRewardError as e:
            raise ConfigError(e.field, e.detail) from None

    def check(self):
        if not self.rewards and self.multi_turn.environment is None:
            raise ConfigError("rewards", "is empty: give a reward function, or a multi_turn.environment whose "
                                         "reward(messages) scores the episodes")
        if self.multi_turn.enabled and not self.chat_template:
            raise ConfigError("multi_turn", "needs chat_template: true (episodes are chat conversations)")
        for i, spec in enumerate(self.rewards):
            if not isinstance(spec, dict):
                raise ConfigError(f"rewards[{i}]", f"must be a mapping like {{name: math}}, got {spec!r}")
            if "model" in spec:
                self._check_model_reward(i, spec)
                continue
            bad = [k for k in spec if k not in _REWARD_KEYS]
            if bad:
                near = hint_text(str(bad[0]), hint(str(bad[0]), list(_REWARD_KEYS), list(_REWARD_KEYS)),
                                 f"rewards[{i}]")
                raise ConfigError(f"rewards[{i}].{bad[0]}",
                                  f"is not a reward option{near} (allowed: {', '.join(_REWARD_KEYS)})")
            if ("name" in spec) == ("fn" in spec):
                raise ConfigError(f"rewards[{i}]", "needs exactly one of name (a built-in: math, format) or "
                                                   "fn ('module.path:function')")
        if self.behaviour_correction != "none" and self.old_logprobs != "recompute":
            raise ConfigError("behaviour_correction", f"{self.behaviour_correction} needs old_logprobs: recompute "
                                                      f"(with the engine's logprobs as the old ones the weight "
                                                      f"exp(old_lp - engine_lp) is 1), got old_logprobs: "
                                                      f"{self.old_logprobs}")
        if self.mis_low >= self.mis_high:
            raise ConfigError("mis_low", f"must be < mis_high ({self.mis_high}), got {self.mis_low}")
        if self.overlong == "penalty" and self.overlong_buffer > self.max_new_tokens:
            raise ConfigError("overlong_buffer", f"must be <= max_new_tokens ({self.max_new_tokens}), "
                                                 f"got {self.overlong_buffer}")


ADVANTAGES = ("grpo", "rloo", "reinforce++", "reinforce++_baseline")


@dataclasses.dataclass
class GRPOConfig(RLConfig):
    advantage: str = opt("grpo", "the advantage estimator (verl's adv_estimator): grpo (r - the group's mean, "
                                 "over its std with scale_rewards); rloo (r - the mean of the group's other "
                                 "samples, TRL's RLOO); reinforce++ (OpenRLHF: the KL to the reference in the "
                                 "per-token reward, returns whitened over the batch, no critic); "
                                 "reinforce++_baseline (the same after the group's mean is subtracted). "
                                 "docs/estimators.md", choices=ADVANTAGES)
    scale_rewards: bool | None = opt(None, "divide group-centred rewards by the group's std: null is the "
                                           "advantage's own (grpo: true; rloo and reinforce++: false); false "
                                           "with grpo: Dr. GRPO's advantage")
    kl_coef: float = opt(0.0, "weight of the KL to the frozen reference model (0: no reference model is kept): "
                              "the k3 KL in the loss; with advantage reinforce++ or reinforce++_baseline the k1 "
                              "KL (old_lp - ref_lp) per token in the reward instead", ge=0)
    dynamic_sampling: bool = opt(False, "DAPO's dynamic sampling: drop groups whose rewards are all equal "
                                        "and sample more prompts to refill the batch")
    dynamic_sampling_max_rounds: int = opt(3, "dynamic sampling: most extra rollout rounds per step", ge=0)

    @property
    def scales_rewards(self) -> bool:
        """Whether the group-centred rewards are divided by the group's std (scale_rewards resolved)."""
        return self.advantage == "grpo" if self.scale_rewards is None else self.scale_rewards

    @property
    def kl_in_reward(self) -> bool:
        """REINFORCE++'s KL: in the per-token reward, not in the loss."""
        return self.advantage.startswith("reinforce++")

    def check(self):
        super().check()
        if self.group_size < 2 and self.advantage != "reinforce++":
            raise ConfigError("group_size", f"must be >= 2 for advantage {self.advantage} (advantages are "
                                            f"relative to the group), got {self.group_size}")
        if self.dynamic_sampling and self.group_size < 2:
            raise ConfigError("dynamic_sampling", f"keeps groups whose rewards differ, which needs group_size >= 2, "
                                                  f"got {self.group_size}")
        if self.scale_rewards and self.advantage != "grpo":
            raise ConfigError("scale_rewards", f"true is GRPO's std scaling; advantage {self.advantage} scales "
                                               f"by nothing (rloo) or whitens over the batch (reinforce++): "
                                               f"leave it null or false")


@dataclasses.dataclass
class CriticConfig(Section):
    path: str | None = opt(None, "HF folder of the critic's trunk; null: a copy of the policy's initial weights "
                                 "(with lora: an adapter of the lora section's shape on the policy's base)")
    optim: OptimConfig = opt(OptimConfig, "the critic's optimizer and learning-rate schedule")
    value_clip: float = opt(0.2, "clip the new value to v_old +- value_clip in the value loss (0: no clipping)",
                            ge=0)
    head_init_std: float = opt(0.0, "std of the value head's initial weights (0: zeros, so V starts at 0)", ge=0)
    warmup_steps: int = opt(0, "steps at the start that train only the critic (the policy is frozen)", ge=0)


@dataclasses.dataclass
class PPOConfig(RLConfig):
    group_size: int = opt(1, "completions sampled per prompt", ge=1)
    critic: CriticConfig = opt(CriticConfig, "the value model: a value head on a Qwen3 trunk")
    gamma: float = opt(1.0, "discount of GAE", ge=0, le=1)
    lam: float = opt(0.95, "lambda of GAE", ge=0, le=1)
    kl_coef: float = opt(0.05, "per-token KL penalty in the reward: r_t -= kl_coef (old_lp - ref_lp) "
                               "(0: no reference model is kept)", ge=0)
    reward_norm: bool = opt(True, "normalise the scores by their running mean and std")
    whiten_advantages: bool = opt(True, "whiten the advantages over the batch")
