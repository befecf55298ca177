"""PPO with a reward model and a critic at the Qwen3-4B shape: the four-model loop of issue 38 in one
process (the policy, whose weights the engine reads in place; the frozen reference; the reward
model; the critic), one GPU.

Protocol: random bf16 weights, every model at the 4B shape (bench/common.py SHAPES["4b"]; the
reward model a one-label head on a 4B trunk, the critic a value head on a copy of the policy);
64 prompts of 128 random token ids, one completion each of 256 tokens (EOS ignored), kl_coef 0.05,
mu 1, full gradient checkpointing, micro-batches of 16384 tokens, the policy's and the critic's
optimizers in the bf16 memory mode (no master, bf16 moments and gradients: bench/common.py
MEMORY_MODES; fp32 master and moments for two 4B models do not fit one H200 beside the other
two), the reward model kept on the device (offload false; --offload true moves it to host memory
between scorings). The reward model reads the policy's token ids (one tokenizer). Reported: the
median step time after warm-up, each phase's time and peak allocated memory (rollout = generate and
score, the reward model's own time apart; ref_logprobs; critic_values; actor_train; critic_train),
the run's peak, and the memory model's estimate of it (rlcu.memory).

Peer: none run. TRL's PPOTrainer (trl.experimental in TRL 1.x) builds the same four models, but
generates through transformers' generate and holds fp32 Adam state of two models; it is not
measured here yet.

    python bench/ppo_rm.py                 # the 4B shape on the GPU -> bench/results/ppo_rm.json
    python bench/ppo_rm.py --tiny          # tiny shapes on whatever device (a CPU smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MEMORY_MODES, SHAPES, write_json  # noqa: E402

TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
PROTOCOL = dict(prompts=64, prompt_len=128, completion_len=256)
TINY_PROTOCOL = dict(prompts=4, prompt_len=8, completion_len=8)


class PhaseMeter:
    """rlcu.train.core.Hooks that time each phase of a step and record its peak allocated memory."""

    preemptible = False

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str, **info):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
                self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def reset(self):
        self.seconds, self.peaks = {}, {}

    def yield_check(self) -> bool:
        return False

    def on_yield(self, tokens_left: int) -> None:
        pass

    def on_generate_done(self) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def stop_reason(self):
        return None


def build(tiny: bool, offload: bool, micro_batch_tokens: int, steps: int):
    from rlcu.config import PPOConfig, _build
    from rlcu.data.tokenizer import make_word_tokenizer
    from rlcu.model.causal_lm import CausalLM
    from rlcu.model.config import CausalLMConfig
    from rlcu.model.reward_model import RewardModel
    from rlcu.rewards.model_reward import ModelReward
    from rlcu.train.ppo import PPOTrainer

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = CausalLMConfig(**(TINY if tiny else SHAPES["4b"]), eos_token_id=1, bos_token_id=None)
    proto = TINY_PROTOCOL if tiny else PROTOCOL
    P, Lp, Lc = proto["prompts"], proto["prompt_len"], proto["completion_len"]
    policy = CausalLM.from_config(cfg, device=dev, dtype=dtype, seed=0)
    policy.gradient_checkpointing = True
    rm = RewardModel.from_causal_lm(CausalLM.from_config(cfg, device=dev, dtype=dtype, seed=1), head_init_std=0.02,
                                    seed=1)
    tok = make_word_tokenizer([f"t{i}" for i in range(1, cfg.vocab_size)])
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_token_ids": p} for p in torch.randint(2, cfg.vocab_size, (P * steps, Lp), generator=g).tolist()]
    block = 16
    kv_blocks = P * -(-(Lp + Lc + 1) // block) + 64
    mode = MEMORY_MODES["default" if tiny and not cuda else "bf16"]
    pcfg = _build(PPOConfig, dict(
        steps=steps, prompts_per_step=P, group_size=1, max_new_tokens=Lc, stop_at_eos=False, temperature=1.0, mu=1,
        kl_coef=0.05, micro_batch_tokens=micro_batch_tokens, optim=dict(lr=1e-6, **mode),
        critic=dict(optim=dict(lr=1e-6, **mode)), data=dict(shuffle=False),
        engine=dict(max_num_seqs=P, block_size=block, num_kv_blocks=kv_blocks,
                    max_num_batched_tokens=max(8192, P * Lp)),
        log=dict(out_dir=tempfile.mkdtemp(prefix="rlcu-bench-ppo-rm-"), progress=False, tensorboard=False, plot=False),
        checkpoint=dict(save_at_end=False)))
    meter = PhaseMeter(cuda)
    reward = ModelReward(rm, max_tokens=micro_batch_tokens, offload=offload)
    tr = PPOTrainer(pcfg, rows, [{"model": reward, "name": "rm"}], model=policy, tokenizer=tok, hooks=meter)
    return tr, meter, proto


def run(tiny: bool, offload: bool, steps: int, warmup: int, micro_batch_tokens: int) -> dict:
    from rlcu.memory import GiB, job_memory

    cuda = torch.cuda.is_available()
    tr, meter, proto = build(tiny, offload, micro_batch_tokens, warmup + steps)
    times, phases, rm_s = [], [], []
    for s in range(warmup + steps):
        if s == warmup:
            meter.reset()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        if cuda:
            torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
            phases.append(dict(meter.seconds))
            rm_s.append(m.get("time/reward/rm", float("nan")))
            meter.seconds = {}
    est = job_memory(tr._memory_shape())
    res = {"protocol": proto, "shape": "tiny" if tiny else "Qwen3-4B (policy, reference, reward model, critic)",
           "offload": offload, "micro_batch_tokens": micro_batch_tokens, "s_per_step": statistics.median(times),
           "steps": times, "phases_s": {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]},
           "reward_model_s": statistics.median(rm_s),
           "tokens_per_step": proto["prompts"] * (proto["prompt_len"] + proto["completion_len"]),
           "estimate_peak_GiB": est.peak / GiB,
           "estimate_parts_GiB": {k: getattr(est, k) / GiB for k in ("weights", "optimizer_state", "reference",
                                                                      "critic", "reward_model", "reward_work",
                                                                      "kv_pool")}}
    if cuda:
        res["phase_peak_GiB"] = {k: v / GiB for k, v in meter.peaks.items()}
        res["peak_GiB"] = max(meter.peaks.values()) / GiB
        res["between_steps_GiB"] = torch.cuda.memory_allocated() / GiB
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--offload", choices=("false", "true"), default="false",
                    help="the reward model's weights in host memory between scorings")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and sequences (a CPU smoke test)")
    a = ap.parse_args()
    res = run(a.tiny, a.offload == "true", a.steps, a.warmup, a.micro_batch_tokens)
    suffix = "_offload" if a.offload == "true" else ""
    path = write_json(f"ppo_rm_tiny{suffix}.json" if a.tiny else f"ppo_rm{suffix}.json", {"rlcu": res})
    print(f"{res['s_per_step']:.3f} s/step, phases {res['phases_s']}, peak {res.get('peak_GiB', 0):.1f} GiB "
          f"(estimate {res['estimate_peak_GiB']:.1f}) -> {path}")


if __name__ == "__main__":
    main()
