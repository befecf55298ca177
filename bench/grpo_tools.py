"""A multi-turn GRPO step with a tool (issue 36), rlcu against TRL's GRPOTrainer(tools=...) in the
same run, on the Qwen3-0.6B shape with random bf16 weights, each side in its own process.

The shape is the issue's: 8 prompts x 8 episodes, a prompt of 128 words, 4 model turns of 128
tokens each, the first 3 ending in a call of the tool `lookup`, which sleeps 50 ms and answers 64
tokens; the reward is bench/grpo.py's hash of the conversation; one optimizer step per batch,
gradient checkpointing, no KL. Reported per side: seconds per step (median after warm-up), model
and trajectory tokens per second of the step, peak GPU memory; rlcu adds its phases (generate /
logprobs / train) and the episodes' metrics (turns, tool calls, tool seconds).

A random model never writes a parseable tool call, so on both sides the turns are scripted the
same way, and only the model's decision is: each turn is exactly --turn-tokens sampled tokens (EOS
ignored), and the first turns-1 turns count as one call of `lookup` whatever was sampled. rlcu:
`ScriptedTurns` replaces the episode's parser (rlcu.tools.episode.EpisodeState) and reads a turn
cut at max_new_tokens as ended; everything else is rlcu's own path (LLM.run_episodes, the tool run
in its pool under the time limit, the chat template's tool turn, env tokens without loss).
TRL 1.16: `parse_response` in trl.trainer.grpo_trainer is replaced by one that reports the call,
max_tool_calling_iterations = turns-1 and generation_kwargs {min,max}_new_tokens = turn tokens;
everything else is TRL's own multi-turn tool loop (transformers' generate, no vLLM: the H200 image
has none, and TRL's tool loop needs none): after each turn its tools run one sample after another
in the trainer's thread, and the next turn re-generates with the whole trajectory as its prompt.
One difference of rendering: TRL's tool suffix starts after the assistant's <|im_end|>, which it
takes to be sampled; rlcu's environment tokens carry that close when the turn did not sample it,
so an rlcu trajectory is one token longer per tool turn.

Tokenizer: word i is "t{i}" (one token each) plus the ChatML specials and a tool-calling chat
template, on both sides, so a 64-word tool answer is 64 tokens.

    python bench/grpo_tools.py                    # both sides at the 0.6B shape (the H200 run)
    python bench/grpo_tools.py --quick            # a tiny model on the CPU, both sides, short shape
    python bench/grpo_tools.py --sides rlcu --tool-sleep 0
"""

from __future__ import annotations

import argparse
import gc
import itertools
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

from bench.common import MEMORY_MODES, trl_step_timer, write_json  # noqa: E402
from bench.grpo import _buffer_arithmetic, _model_cfg, _PhasePeaks, _sync, hash_reward  # noqa: E402

SHAPE = dict(prompts=8, group=8, prompt_len=128, turns=4, turn_tokens=128, tool_tokens=64, tool_sleep=0.05)
QUICK = dict(prompts=2, group=2, prompt_len=16, turns=4, turn_tokens=8, tool_tokens=8, tool_sleep=0.01)
ROLES = ["user", "assistant", "tool", "system"]
SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}{{- ' <tool_call> ' + tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() %}{{- ' ' + k + ' ' + v|string }}{%- endfor %}"
    "{{- ' </tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOOL = {"sleep": 0.05, "tokens": 64, "words": 1000}
_calls = itertools.count()


def lookup(name: str) -> str:
    """Look up a record by name.

    Args:
        name: The record's name.
    """
    k = next(_calls)
    time.sleep(TOOL["sleep"])
    return " ".join(f"t{(k * 7919 + j * 104729) % TOOL['words'] + 1}" for j in range(TOOL["tokens"]))


def chat_words(V: int) -> list[str]:
    """The roles and "t1".."tN", so that with <unk> and the specials the vocabulary is V."""
    return ROLES + [f"t{i}" for i in range(1, V - len(ROLES) - len(SPECIAL))]


def rows(V: int, n: int, L: int, seed: int = 0) -> list[dict]:
    """n conversational prompts of L words each (both sides' dataset)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(1, V - len(ROLES) - len(SPECIAL), (n, L), generator=g).tolist()
    return [{"prompt": [{"role": "user", "content": " ".join(f"t{i}" for i in p)}]} for p in words]


def _expected_tokens(shape: dict) -> int:
    return shape["prompts"] * shape["group"] * shape["turns"] * shape["turn_tokens"]


# ---------------------------------------------------------------- rlcu
def _scripted_turns(turns: int):
    """rlcu's episode with the model's decision scripted (the module docstring): turns 1..turns-1
    call lookup, the last answers; a turn cut at max_new_tokens counts as ended."""
    from rlcu.tools.calls import ParsedCalls, ToolCall
    from rlcu.tools.episode import EpisodeState

    class ScriptedTurns(EpisodeState):
        def _parse(self, turn_ids):
            text = self.renderer.tokenizer.decode(turn_ids, skip_special_tokens=False)
            if self.stats.turns < turns:  # (counted before the parse)
                return ParsedCalls(text, [ToolCall("lookup", {"name": "t1"}, "")])
            return ParsedCalls(text)

        def on_turn(self, turn_ids, finish_reason):
            return super().on_turn(turn_ids, "stop")

    return ScriptedTurns


def bench_rlcu(shape: dict, steps: int, warmup: int, tiny: bool, micro_batch_tokens: int,
               memory_mode: str = "default") -> dict:
    from rlcu.train import episodes

    kept, episodes.EpisodeState = episodes.EpisodeState, _scripted_turns(shape["turns"])
    try:
        return _rlcu_steps(shape, steps, warmup, tiny, micro_batch_tokens, memory_mode)
    finally:
        episodes.EpisodeState = kept  # (the tests run this side in their own process)


def _rlcu_steps(shape: dict, steps: int, warmup: int, tiny: bool, micro_batch_tokens: int, memory_mode: str) -> dict:
    from rlcu.config import GRPOConfig, _build
    from rlcu.data.tokenizer import make_word_tokenizer
    from rlcu.model.causal_lm import Qwen3
    from rlcu.train.grpo import GRPOTrainer

    cuda = torch.cuda.is_available()
    cfg = _model_cfg(tiny)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    model = Qwen3.from_config(cfg, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32,
                              seed=0)
    model.gradient_checkpointing = True
    tok = make_word_tokenizer(chat_words(cfg.vocab_size), special_tokens=SPECIAL, chat_template=CHAT_TEMPLATE)
    P, G, T, turns = shape["prompts"], shape["group"], shape["turn_tokens"], shape["turns"]
    total = warmup + steps
    ep_tokens = turns * (T + shape["tool_tokens"] + 16)
    block = 16
    kv_blocks = P * G * (-(-(shape["prompt_len"] + 8 + ep_tokens) // block)) + 64
    gcfg = _build(GRPOConfig, dict(
        steps=total, prompts_per_step=P, group_size=G, max_new_tokens=T, temperature=1.0, stop_at_eos=False,
        mu=1, micro_batch_tokens=micro_batch_tokens, optim=dict(lr=1e-6, **MEMORY_MODES[memory_mode]),
        data=dict(shuffle=False),
        multi_turn=dict(max_turns=turns, max_episode_tokens=ep_tokens, tool_workers=P * G),
        engine=dict(max_num_seqs=P * G, block_size=block, num_kv_blocks=kv_blocks,
                    max_num_batched_tokens=max(8192, P * shape["prompt_len"])),
        log=dict(out_dir=tempfile.mkdtemp(prefix="rlcu-bench-grpo-tools-"), progress=False, tensorboard=False,
                 plot=False),
        checkpoint=dict(save_at_end=False)))
    tr = GRPOTrainer(gcfg, rows(cfg.vocab_size, P * total, shape["prompt_len"]), [hash_reward], model=model,
                     tokenizer=tok, tools=[lookup])
    pp = _PhasePeaks(tr) if cuda else None
    times, phases, eps, toks = [], [], [], []
    for s in range(total):
        if s == warmup and cuda:
            pp.reset()
        _sync()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        _sync()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
            phases.append({k[5:]: m[k] for k in ("time/generate", "time/logprobs", "time/train") if k in m})
            eps.append({k: m[k] for k in m if k.startswith("episodes/")})
            toks.append(m["completion_len"] * P * G)
    sps = statistics.median(times)
    model_tokens = _expected_tokens(shape)
    res = {"s_per_step": sps, "steps": times, "phases_s": {k: statistics.median(p[k] for p in phases)
                                                         for k in phases[0]},
           "episodes": eps[-1], "model_tokens_per_step": model_tokens,
           "trajectory_tokens_per_step": statistics.median(toks), "model_tokens_per_s": model_tokens / sps,
           "trajectory_tokens_per_s": statistics.median(toks) / sps,
           "generate_model_tokens_per_s": model_tokens / statistics.median(p["generate"] for p in phases),
           "memory_mode": memory_mode, "micro_batch_tokens": micro_batch_tokens,
           "buffers_GiB": _buffer_arithmetic(tr, kv_blocks, block)}
    if cuda:
        res["peak_GiB"] = (pp.peak() - base) / 2**30
        res["phase_peak_GiB"] = {k: (v - base) / 2**30 for k, v in pp.peaks.items()}
    del tr, model
    gc.collect()
    return res


# ---------------------------------------------------------------- TRL
def _scripted_parse():
    """TRL's parse_response with the model's decision scripted: every turn calls lookup (TRL stops
    after max_tool_calling_iterations = turns-1 tool rounds, so the last turn's call is not run)."""

    def parse(tokenizer, ids, prefix=None, tools=None):
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True),
                "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"name": "t1"}}}]}

    return parse


# what the TRL side scripts and bounds TRL's tool loop with (TRL 1.16): without any of them the
# run would measure something else, or loop on the scripted calls without max_tool_calling_iterations
TRL_NEEDS = ("trl.trainer.grpo_trainer.parse_response", "GRPOTrainer(tools=...)",
             "GRPOConfig.max_tool_calling_iterations", "GRPOConfig.generation_kwargs")


def trl_api_gaps(trl, grpo_trainer) -> list[str]:
    """What of TRL_NEEDS this TRL lacks (empty: the bench can run it)."""
    import dataclasses
    import inspect

    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    have = (callable(getattr(grpo_trainer, "parse_response", None)),
            "tools" in inspect.signature(trl.GRPOTrainer.__init__).parameters,
            "max_tool_calling_iterations" in fields, "generation_kwargs" in fields)
    return [need for need, ok in zip(TRL_NEEDS, have) if not ok]


def bench_trl(shape: dict, steps: int, warmup: int, tiny: bool) -> dict:
    try:
        import datasets  # noqa: F401
        import trl
        from trl.trainer import grpo_trainer
    except ImportError as e:
        return {"error": f"TRL side skipped: {e} (install trl, datasets)"}
    gaps = trl_api_gaps(trl, grpo_trainer)
    if gaps:
        return {"error": f"TRL {trl.__version__} lacks {', '.join(gaps)}: this bench scripts TRL 1.16's tool loop "
                         f"(module docstring), so its TRL side does not run", "trl": trl.__version__}
    kept, grpo_trainer.parse_response = grpo_trainer.parse_response, _scripted_parse()
    try:
        return _trl_steps(shape, steps, warmup, tiny)
    finally:
        grpo_trainer.parse_response = kept


def _trl_steps(shape: dict, steps: int, warmup: int, tiny: bool) -> dict:
    import dataclasses

    import datasets
    import trl
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM
    from transformers import Qwen3Config as HFConfig

    from rlcu.data.tokenizer import make_word_tokenizer

    cuda = torch.cuda.is_available()
    cfg = _model_cfg(tiny)
    hcfg = HFConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type",
                                                                                "torch_dtype")})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hcfg).to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    wt = make_word_tokenizer(chat_words(cfg.vocab_size), special_tokens=SPECIAL, chat_template=CHAT_TEMPLATE)
    tok = PreTrainedTokenizerFast(tokenizer_object=wt.backend, unk_token="<unk>", pad_token="<|endoftext|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = "scripted: bench/grpo_tools.py replaces parse_response"  # (skips add_response_schema)
    P, G, T, turns = shape["prompts"], shape["group"], shape["turn_tokens"], shape["turns"]
    total = warmup + steps
    ds = datasets.Dataset.from_list(rows(cfg.vocab_size, P * total, shape["prompt_len"]))
    want = dict(output_dir=tempfile.mkdtemp(prefix="trl-bench-grpo-tools-"), per_device_train_batch_size=P * G,
                gradient_accumulation_steps=1, num_generations=G,
                max_completion_length=turns * (T + shape["tool_tokens"] + 16), gradient_checkpointing=True,
                bf16=cuda, learning_rate=1e-6, beta=0.0, temperature=1.0, num_iterations=1, steps_per_generation=1,
                max_steps=total, logging_steps=1, report_to=[], save_strategy="no", shuffle_dataset=False, seed=0,
                generation_kwargs={"min_new_tokens": T, "max_new_tokens": T},
                max_tool_calling_iterations=turns - 1, use_cpu=not cuda)
    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    args = trl.GRPOConfig(**{k: v for k, v in want.items() if k in names})
    times: list[float] = []
    logged: list[dict] = []

    timer = trl_step_timer(times, warmup, cuda, logged)

    trainer = trl.GRPOTrainer(model=model, reward_funcs=[hash_reward], args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[timer], tools=[lookup])
    trainer.train()
    sps = statistics.median(times) if times else None
    last = next((x for x in reversed(logged) if "tools/call_frequency" in x), logged[-1] if logged else {})
    res = {"s_per_step": sps, "steps": times, "trl": trl.__version__,
           "config_fields_not_in_this_trl": sorted(k for k in want if k not in names),
           "model_tokens_per_step": _expected_tokens(shape),
           "logged": {k: v for k, v in last.items() if k.startswith(("tools/", "completions/", "num_tokens"))}}
    # TRL logs the model's tokens only (completions/mean_length); a trajectory adds turns-1 tool
    # suffixes, each as TRL's own _get_tool_suffix_ids renders it
    if not callable(getattr(trainer, "_get_tool_suffix_ids", None)):  # private in 1.16: the figure, not the run
        res["error_trajectory_tokens"] = f"TRL {trl.__version__} has no GRPOTrainer._get_tool_suffix_ids"
        suffix = None
    else:
        suffix = len(trainer._get_tool_suffix_ids([{"role": "tool", "name": "lookup", "content": lookup("t1")}]))
        res["trajectory_tokens_per_step"] = P * G * (turns * T + (turns - 1) * suffix)
    if sps:
        res["model_tokens_per_s"] = _expected_tokens(shape) / sps
        if suffix is not None:
            res["trajectory_tokens_per_s"] = res["trajectory_tokens_per_step"] / sps
    if cuda:
        res["peak_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


# ---------------------------------------------------------------- driver
def run_side(side: str, a) -> dict:
    shape = dict(QUICK if a.tiny else SHAPE)
    if a.tool_sleep is not None:
        shape["tool_sleep"] = a.tool_sleep
    TOOL.update(sleep=shape["tool_sleep"], tokens=shape["tool_tokens"], words=1000 if not a.tiny else 500)
    if side.startswith("rlcu"):
        mode = "bf16" if side == "rlcu_bf16" else "default"
        return bench_rlcu(shape, a.steps, a.warmup, a.tiny, a.micro_batch_tokens, mode)
    return bench_trl(shape, a.steps, a.warmup, a.tiny)


def _row(side: str, r: dict, res: dict) -> str:
    if not r.get("s_per_step"):
        return f"{side:<10} {str(r.get('error', 'no result'))[-300:]}"
    pk = f"{r['peak_GiB']:.2f}" if "peak_GiB" in r else "-"
    sp = res.get("speedup_vs_trl" + ("_bf16" if side == "rlcu_bf16" else ""))
    return (f"{side:<10} {r['s_per_step']:>8.2f} {r.get('model_tokens_per_s', 0):>10,.0f} "
            f"{r.get('trajectory_tokens_per_s', 0):>10,.0f} {pk:>9} {f'{sp:.1f}x' if sp and side != 'trl' else '':>7}")


def _write(a, res: dict) -> Path:
    """The run's JSON, its own name: grpo_tools.json, or grpo_tools_quick.json for a tiny model."""
    name = "grpo_tools_quick.json" if a.tiny else "grpo_tools.json"
    if a.out_dir is None:
        return write_json(name, res)
    from bench.common import meta

    a.out_dir.mkdir(parents=True, exist_ok=True)
    path = a.out_dir / name
    path.write_text(json.dumps({"meta": meta(), **res}, indent=2, default=float))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", default="rlcu,trl", help="rlcu, rlcu_bf16, trl (comma-separated)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--tool-sleep", type=float, default=None, help="seconds each tool call sleeps (default 0.05)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="rlcu's micro-batch")
    ap.add_argument("--quick", action="store_true", help="a tiny model and a short shape, 1 warm-up + 1 timed step "
                                                         "(a CPU smoke run of both sides)")
    ap.add_argument("--timeout", type=int, default=280, help="seconds per side (killed past it, its error in the "
                                                             "JSON; the default fits both in a 10-minute call)")
    ap.add_argument("--out-dir", type=Path, default=None, help="write the JSON here (default bench/results/)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and the short shape, the full steps (CPU)")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.tiny, a.steps, a.warmup = True, 1, 1
    if a.side:
        print("RESULT " + json.dumps(run_side(a.side, a)), flush=True)
        return 0
    t0 = time.time()
    shape = dict(QUICK if a.tiny else SHAPE, **({} if a.tool_sleep is None else {"tool_sleep": a.tool_sleep}))
    res = {"shape": shape, "tiny": a.tiny, "timed_steps": a.steps, "warmup_steps": a.warmup,
           "method": "Qwen3-0.6B shape, random bf16 weights, turns of exactly turn_tokens sampled tokens (EOS "
                     "ignored), the first turns-1 scripted as a call of the tool on both sides (module docstring), "
                     "gradient checkpointing, one optimizer step per batch, no KL; median s/step after warm-up; "
                     "each side in its own process"}
    sides = a.sides.split(",")
    for side in sides:
        cmd = [sys.executable, __file__, "--side", side, "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--micro-batch-tokens", str(a.micro_batch_tokens)]
        cmd += ["--tiny"] if a.tiny else []
        cmd += [] if a.tool_sleep is None else ["--tool-sleep", str(a.tool_sleep)]
        try:
            pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = [x for x in pr.stdout.splitlines() if x.startswith("RESULT ")]
            res[side] = json.loads(line[-1][7:]) if line else {"error": (pr.stderr or pr.stdout)[-1500:]}
        except subprocess.TimeoutExpired as e:  # run() killed the side: its output so far says where it was
            tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            res[side] = {"error": f"timed out after {a.timeout} s (--timeout); its last output: {tail[-800:]}"}
        _write(a, res)  # after each side: a run cut short keeps the sides it finished
    t = res.get("trl", {})
    for side, suffix in (("rlcu", ""), ("rlcu_bf16", "_bf16")):
        r = res.get(side, {})
        if r.get("s_per_step") and t.get("s_per_step"):
            res["speedup_vs_trl" + suffix] = t["s_per_step"] / r["s_per_step"]
            if r.get("peak_GiB") and t.get("peak_GiB"):
                res["memory_ratio_vs_trl" + suffix] = r["peak_GiB"] / t["peak_GiB"]
    res["wall_s"] = time.time() - t0
    path = _write(a, res)
    print(f"\n{'multi-turn':<10} {'s/step':>8} {'model t/s':>10} {'traj t/s':>10} {'peak GiB':>9} {'vs TRL':>7}")
    for side in sides:
        print(_row(side, res.get(side, {}), res))
    print(f"wrote {path}")
    return 0 if all(res.get(s, {}).get("s_per_step") for s in sides) else 1


if __name__ == "__main__":
    sys.exit(main())
