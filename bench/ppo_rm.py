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

Peer, in the same call and its own process: TRL's PPOTrainer (trl.experimental.ppo; TRL 1.13
removed it, huggingface/trl#7020, so TRL 1.16 has none and its row is an error naming that; pass
--trl-path DIR with trl 1.12.0 installed there by `pip install --no-deps --target DIR
trl==1.12.0` to run it) with the same four models as transformers' classes at the same shape:
Qwen3ForCausalLM policy and reference, one-label Qwen3ForSequenceClassification reward and value
models, random bf16 weights, the same 64 prompts of 128 ids (in [2, V): TRL's pad id 0 nowhere),
response_length 256 with no stop token (its generation ignores EOS, so every completion is 256
tokens; checked), temperature 1, kl_coef 0.05, one PPO epoch of one mini-batch a step (one
optimizer step), gradient checkpointing on the policy and the value model, all 64 prompts in one
generate call (local_rollout_forward_batch_size 64; --trl-rollout-batch lowers it) made in eval
mode (so that transformers 5.17 keeps the KV cache of a checkpointed model: TRL generates in train
mode, where 5.17 drops it and recomputes every sequence at each token), micro-batches of
--trl-micro-batch sequences (16: 4 accumulated a step). Its torch AdamW over bf16 parameters
holds bf16 moments and gradients, as rlcu's bf16 memory mode. TRL trains policy and value in
one backward (PolicyAndValueWrapper); its step is timed between on_step_end callbacks
(PPOTrainer calls no on_step_begin), its peak is the timed steps' max_memory_allocated, as
rlcu's.

    python bench/ppo_rm.py --trl-path DIR  # the 4B shape on the GPU, both sides -> bench/results/ppo_rm.json
    python bench/ppo_rm.py --offload true  # rlcu alone, the reward model offloaded -> ppo_rm_offload.json
    python bench/ppo_rm.py --tiny          # tiny shapes on whatever device (a CPU smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MEMORY_MODES, SHAPES, write_json  # noqa: E402
from rlcu.train.core import Hooks  # noqa: E402

TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
PROTOCOL = dict(prompts=64, prompt_len=128, completion_len=256)
TINY_PROTOCOL = dict(prompts=4, prompt_len=8, completion_len=8)


class PhaseMeter(Hooks):
    """rlcu.train.core.Hooks that time each phase of a step and record its peak allocated memory."""

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


# ---------------------------------------------------------------- TRL
def _trl_ppo():
    """(trl, PPOConfig, PPOTrainer) from wherever this TRL keeps its PPO trainer, or an error row."""
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as e:
        return {"error": f"TRL side skipped: {e} (install trl, datasets)"}
    if hasattr(trl, "PPOTrainer"):
        return trl, trl.PPOConfig, trl.PPOTrainer
    try:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as e:
        if e.name != "trl.experimental.ppo":  # it is there but does not import beside this transformers, say
            return {"error": f"TRL {trl.__version__}'s trl.experimental.ppo does not import: {e}",
                    "trl": trl.__version__}
        return {"error": f"TRL {trl.__version__} has no PPO trainer (neither trl.PPOTrainer nor "
                         "trl.experimental.ppo: TRL 1.13 removed it, huggingface/trl#7020); trl 1.12.0 is the last "
                         "with it: pip install --no-deps --target DIR trl==1.12.0, then --trl-path DIR",
                "trl": trl.__version__}
    return trl, PPOConfig, PPOTrainer


def _hf_models(cfg, cuda: bool):
    """transformers' policy, reference (a copy), reward and value models (one label, pad id 0) of
    cfg's shape, random weights, bf16 on the GPU (fp32 on the CPU)."""
    import copy

    import transformers

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
    kind, arch = d.pop("model_type"), cfg.fam.architecture
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)

    def make(seed, cls, **kw):
        hcfg = transformers.AutoConfig.for_model(kind, pad_token_id=0, **kw, **d)
        hcfg._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with torch.device(dev):  # initialised on the device: a 4B model's random init on the CPU takes minutes
            return getattr(transformers, cls)(hcfg).to(dtype)

    policy = make(0, arch)
    seq = arch.replace("ForCausalLM", "ForSequenceClassification")
    return policy, copy.deepcopy(policy), make(1, seq, num_labels=1), make(2, seq, num_labels=1)


def _trl_timer(times: list[float], warmup: int, cuda: bool):
    """A TrainerCallback timing each PPO step from the previous on_step_end (or on_train_begin)
    to its own: TRL's PPOTrainer calls no on_step_begin. The peak counter resets as the first
    timed step begins."""
    from transformers import TrainerCallback

    from bench.common import sync

    class PPOStepTimer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()
            if warmup == 0 and cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, a, state, control, **kw):
            sync()
            if state.global_step > warmup:
                times.append(time.perf_counter() - self.t0)
            if state.global_step == warmup and cuda:
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

    return PPOStepTimer()


def run_trl(tiny: bool, steps: int, warmup: int, micro_batch: int, rollout_batch: int = 0) -> dict:
    """TRL's PPOTrainer on the protocol (the docstring's Peer): its row, or an error naming why not."""
    got = _trl_ppo()
    if isinstance(got, dict):
        return got
    trl, PPOConfig, PPOTrainer = got
    import datasets
    import transformers

    from bench.preference import hf_word_tokenizer
    from rlcu.memory import GiB
    from rlcu.model.config import CausalLMConfig

    cuda = torch.cuda.is_available()
    cfg = CausalLMConfig(**(TINY if tiny else SHAPES["4b"]), eos_token_id=1, bos_token_id=None)
    proto = TINY_PROTOCOL if tiny else PROTOCOL
    P, Lp, Lc = proto["prompts"], proto["prompt_len"], proto["completion_len"]
    rollout_batch = rollout_batch or P
    if P % micro_batch or P % rollout_batch:
        return {"error": f"--trl-micro-batch {micro_batch} or --trl-rollout-batch {rollout_batch} does not divide "
                         f"the {P} prompts of a step"}
    policy, ref, rm, value = _hf_models(cfg, cuda)
    for m in (policy, value):
        m.gradient_checkpointing_enable()
    tok = hf_word_tokenizer(["a"])  # its pad id 0 (no prompt holds it) and eos id
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (P * (warmup + steps), Lp), generator=g)  # rlcu's prompts
    rows = [{"input_ids": p} for p in ids.tolist()]
    lens: list[int] = []
    generate = policy.generate

    def counted(*a, **kw):
        """generate in eval mode (TRL turns dropout off, so only the cache changes: transformers 5.17
        drops the KV cache of a checkpointed model in train mode even without gradients, 5.24 keeps
        it), the completions' length kept to check that every one runs to response_length."""
        policy.eval()
        try:
            out = generate(*a, **kw)
        finally:
            policy.train()
        lens.append(out.sequences.shape[1] - kw["input_ids"].shape[1])
        return out

    policy.generate = counted
    try:
        args = PPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-ppo-"), per_device_train_batch_size=micro_batch,
                         gradient_accumulation_steps=P // micro_batch, num_mini_batches=1, num_ppo_epochs=1,
                         total_episodes=P * (warmup + steps), local_rollout_forward_batch_size=rollout_batch,
                         response_length=Lc,
                         stop_token=None, stop_token_id=None, temperature=1.0, kl_coef=0.05, learning_rate=1e-6,
                         bf16=cuda, use_cpu=not cuda, num_sample_generations=0, logging_steps=1, report_to=[],
                         save_strategy="no", seed=0)
        times: list[float] = []
        trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=rm,
                             train_dataset=datasets.Dataset.from_list(rows), value_model=value,
                             callbacks=[_trl_timer(times, warmup, cuda)])
        trainer.train()
    except (TypeError, ValueError, AttributeError) as e:
        return {"error": f"TRL {trl.__version__}'s PPOTrainer API differs from the one this bench drives "
                         f"(trl.experimental.ppo of 1.10-1.12): {type(e).__name__}: {e}", "trl": trl.__version__}
    if not times or set(lens) != {Lc}:
        return {"error": f"TRL ran {len(times)} timed steps with completions of {sorted(set(lens))} tokens, "
                         f"not {steps} of {Lc}", "trl": trl.__version__}
    res = {"protocol": proto, "trl": trl.__version__, "s_per_step": statistics.median(times), "steps": times,
           "tokens_per_step": P * (Lp + Lc), "micro_batch": micro_batch, "rollout_batch": rollout_batch,
           "transformers": transformers.__version__, "generate_in_eval_mode": True,
           "optimizer": "torch AdamW on bf16 parameters (bf16 m, v and gradients), policy and value together"}
    if cuda:
        res["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
    return res


# ---------------------------------------------------------------- driver
def run_sides(a) -> dict:
    """Each side in its own process (this script with --side S), its RESULT line read back; the
    speed-up and memory ratio against TRL where both ran."""
    res = {}
    for side in a.sides.split(","):
        cmd = [sys.executable, __file__, "--side", side, "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--micro-batch-tokens", str(a.micro_batch_tokens), "--offload", a.offload,
               "--trl-micro-batch", str(a.trl_micro_batch), "--trl-rollout-batch", str(a.trl_rollout_batch)]
        cmd += ["--tiny"] if a.tiny else []
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if side == "trl" and a.trl_path:
            first = str(Path(a.trl_path).resolve())
            env["PYTHONPATH"] = os.pathsep.join(x for x in (first, env.get("PYTHONPATH")) if x)
        try:
            pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
            line = [x for x in pr.stdout.splitlines() if x.startswith("RESULT ")]
            res[side] = json.loads(line[-1][7:]) if line else {"error": (pr.stderr or pr.stdout)[-1500:]}
        except subprocess.TimeoutExpired:
            res[side] = {"error": f"timed out after {a.timeout} s"}
    r, t = res.get("rlcu", {}), res.get("trl", {})
    if r.get("s_per_step") and t.get("s_per_step"):
        res["speedup_vs_trl"] = t["s_per_step"] / r["s_per_step"]
        if r.get("peak_GiB") and t.get("peak_GiB"):
            res["memory_ratio_vs_trl"] = r["peak_GiB"] / t["peak_GiB"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--offload", choices=("false", "true"), default="false",
                    help="the reward model's weights in host memory between scorings")
    ap.add_argument("--sides", help="rlcu,trl (default), or one; rlcu alone with --offload true")
    ap.add_argument("--trl-path", help="a folder put first on the TRL side's PYTHONPATH (trl 1.12.0 installed there)")
    ap.add_argument("--trl-micro-batch", type=int, default=16, help="TRL's per_device_train_batch_size (sequences)")
    ap.add_argument("--trl-rollout-batch", type=int, default=0,
                    help="TRL's local_rollout_forward_batch_size: prompts a generate call (0: all of a step's)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per side")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and sequences (a CPU smoke test)")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.trl_micro_batch = min(a.trl_micro_batch, TINY_PROTOCOL["prompts"])
    if a.side:
        res = (run(a.tiny, a.offload == "true", a.steps, a.warmup, a.micro_batch_tokens) if a.side == "rlcu" else
               run_trl(a.tiny, a.steps, a.warmup, a.trl_micro_batch, a.trl_rollout_batch))
        print("RESULT " + json.dumps(res, default=float))
        return
    a.sides = a.sides or ("rlcu" if a.offload == "true" else "rlcu,trl")
    res = run_sides(a)
    suffix = "_offload" if a.offload == "true" else ""
    path = write_json(f"ppo_rm_tiny{suffix}.json" if a.tiny else f"ppo_rm{suffix}.json", res)
    for side in a.sides.split(","):
        r = res[side]
        if "s_per_step" not in r:
            print(f"{side}: {r.get('error', 'no result')}")
            continue
        est = f" (estimate {r['estimate_peak_GiB']:.1f})" if "estimate_peak_GiB" in r else ""
        print(f"{side}: {r['s_per_step']:.3f} s/step, peak {r.get('peak_GiB', 0):.1f} GiB{est}"
              + (f", phases {r['phases_s']}" if "phases_s" in r else ""))
    if "speedup_vs_trl" in res:
        mem = f", {res['memory_ratio_vs_trl']:.2f}x the memory" if "memory_ratio_vs_trl" in res else ""
        print(f"rlcu vs TRL: {res['speedup_vs_trl']:.2f}x faster{mem}")
    print(path)


if __name__ == "__main__":
    main()
