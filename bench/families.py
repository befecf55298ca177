"""The model families on the H200 in one call (issue 34): the Llama-3.1-8B and Qwen2.5-7B shapes
beside Qwen3-8B, random bf16 weights, each measurement in its own process.

Per shape:
- train: bench/train_step.py's step, 8 x 2048 tokens, rlcu's optimizer in the bf16 memory mode,
  gradient checkpointing auto, fused head; MFU = 3 x forward FLOPs x tokens / time / 989e12
  (target >= 50%);
- generate: bench/generate.py's protocol (256 requests, prompt and output lengths uniform in
  [100, 1024], temperature 0.6, EOS ignored) and its bound (every weight read once a step plus
  the running sequences' KV, or the prefill's matmul FLOPs); target >= 75% of the bound;
- exact: the model built in exact mode, its final norm scaled to a mean entropy of 2.9 nats;
  32 prompts (16-200 tokens) x 8 samples x 128 tokens at temperature 1 from the engine (CUDA
  graphs, chunked prefill), then the trainer's forward over the same sequences: the fraction of
  sampled tokens whose logprobs are equal bit for bit (target 100%); the default mode's
  mismatch beside it.

    python bench/families.py [--shapes 8b,llama3.1-8b,qwen2.5-7b] [--parts train,generate,exact]
    python bench/families.py --quick      # a smoke run on whatever device (tiny shapes' stand-ins)

JSON: bench/results/families.json (and each part's own JSON: train_step_<shape>_auto.json,
generate_<shape>_protocol.json)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import SHAPES, meta, scale_to_entropy, write_json  # noqa: E402

SHAPES_DEFAULT = "8b,llama3.1-8b,qwen2.5-7b"
PROMPTS, N_SAMPLES, NEW, TEMP = 32, 8, 128, 1.0


def _prompts(V: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 200, (n,), generator=g).tolist()
    return [torch.randint(0, V, (L,), generator=g).tolist() for L in lens]


def _sample(m, prompts, new: int, **engine):
    from rlcu.engine import LLM, SamplingParams

    sp = SamplingParams(n=N_SAMPLES, temperature=TEMP, max_tokens=new, ignore_eos=True, seed=5, logprobs=True)
    llm = LLM(m, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    gens = [(p, c.token_ids, c.logprobs) for p, o in zip(prompts, outs) for c in o.outputs]
    llm.sleep()
    del llm
    torch.cuda.empty_cache()
    return gens


def _trainer_logprobs(m, gens, chunk_tokens: int = 32768) -> torch.Tensor:
    """The trainer's forward over the sampled sequences, in packed chunks of whole sequences,
    at the sampled tokens' positions."""
    out, i = [], 0
    while i < len(gens):
        j, n = i, 0
        while j < len(gens) and (j == i or n + len(gens[j][0]) + len(gens[j][1]) <= chunk_tokens):
            n += len(gens[j][0]) + len(gens[j][1])
            j += 1
        seqs = [p + t for p, t, _ in gens[i:j]]
        tokens = torch.tensor([x for s in seqs for x in s], device=m.device)
        cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), device=m.device,
                          dtype=torch.int32)
        lp = m.forward(tokens, cu, temperature=TEMP, grad=False)
        for (p, t, _), s in zip(gens[i:j], cu[:-1].tolist()):
            out.append(lp[s + len(p):s + len(p) + len(t)].float().cpu())
        i = j
    return torch.cat(out)


def _stats(eng: torch.Tensor, tr: torch.Tensor) -> dict:
    d = (tr - eng).double()
    r = d.exp()
    return {"tokens": d.numel(), "exact_frac": float((d == 0).double().mean()), "abs_mean": float(d.abs().mean()),
            "abs_max": float(d.abs().max()), "ratio_p01": float(r.quantile(0.01)),
            "ratio_p99": float(r.quantile(0.99))}


def exact_side(shape: str, quick: bool) -> dict:
    """Engine against trainer in the default mode and in exact mode, on one model (its mode switched)."""
    from bench.generate import random_model
    from rlcu.model.config import Qwen3Config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(SHAPES[shape])
    if quick:
        kw.update(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=4096)
    cfg = Qwen3Config(**kw)
    m = random_model(cfg, dev)
    scale_to_entropy(m, 2.9, tokens=1024 if quick else 4096)
    prompts = _prompts(cfg.vocab_size, 4 if quick else PROMPTS)
    new = 16 if quick else NEW
    engine = {"num_kv_blocks": 4096, "max_num_batched_tokens": 2048}  # prefills come in chunks
    if dev == "cpu":
        engine["enforce_eager"] = True
    res = {}
    for mode in (False, True):
        m.exact = mode
        t0 = time.time()
        gens = _sample(m, prompts, new, **engine)
        eng = torch.tensor([x for _, _, lps in gens for x in lps])
        res["exact" if mode else "default"] = {**_stats(eng, _trainer_logprobs(m, gens)),
                                               "wall_s": time.time() - t0}
    return res


def _run(cmd: list[str], timeout: int) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT}" + (f":{os.environ['PYTHONPATH']}"
                                                                  if os.environ.get("PYTHONPATH") else ""))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
        return p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), f"timeout {timeout} s"


def _written_since(path: Path, t0: float) -> bool:
    """The part's JSON was written by this run (bench/results holds earlier runs' files)."""
    return path.exists() and path.stat().st_mtime >= t0 - 1


def _train(shape: str, quick: bool, timeout: int) -> dict:
    args = ["--batch", "8", "--seqlen", "2048", "--memory-mode", "bf16", "--steps", "4", "--warmup", "1"]
    if quick:
        return {"skipped": "--quick"}
    t0 = time.time()
    name = f"train_step_{shape}_auto.json"
    out, err = _run([sys.executable, "bench/train_step.py", "--shape", shape, "--sides", "rlcu_auto", "--json", name,
                     *args], timeout)
    path = ROOT / "bench/results" / name
    if not _written_since(path, t0):
        return {"error": (err or out)[-800:]}
    r = json.loads(path.read_text()).get("rlcu_auto", {})
    return {k: r[k] for k in ("ms", "tok_s", "mfu", "peak_GiB", "gradient_checkpointing", "error") if k in r}


def _generate(shape: str, quick: bool, timeout: int) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "bench/generate.py", "--shape", shape, "--no-hf", "--protocol-only"]
    out, err = _run(cmd + (["--quick"] if quick else []), timeout)
    name = "generate_quick" if quick else "generate" + ("" if shape == "0.6b" else f"_{shape}")
    name += "_protocol.json"
    path = ROOT / "bench/results" / name
    if not _written_since(path, t0):
        return {"error": (err or out)[-800:]}
    d = json.loads(path.read_text())
    rows = [r for r in d.get("rlcu", []) if r["case"].startswith("protocol")]
    if not rows:
        return {"error": (err or out)[-800:]}
    r = rows[0]
    return {"tok_per_s": r["tok_per_s"], "bound_fraction": r["bound_fraction"], "wall_s": r["wall_s"],
            "decode_bound_fraction": r["decode"]["bound_fraction"], "params": d["config"]["params"]}


def _exact(shape: str, quick: bool, timeout: int) -> dict:
    out, err = _run([sys.executable, __file__, "--exact-side", shape] + (["--quick"] if quick else []), timeout)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[-1][7:]) if line else {"error": (err or out)[-800:]}


PARTS = {"train": _train, "generate": _generate, "exact": _exact}


def _merged(res: dict) -> dict:
    """This run's parts over the earlier families.json's (each part carries its own meta: a part
    re-measured alone, e.g. exact mode at one shape, replaces only itself)."""
    path = ROOT / "bench/results/families.json"
    old = json.loads(path.read_text()).get("shapes", {}) if path.exists() else {}
    shapes = {s: {**old.get(s, {}), **row} for s, row in {**old, **res["shapes"]}.items()}
    return {**res, "shapes": shapes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES_DEFAULT)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per part and shape")
    ap.add_argument("--exact-side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.exact_side:
        print("RESULT " + json.dumps(exact_side(a.exact_side, a.quick)), flush=True)
        return 0
    t0 = time.time()
    res = {"protocol": __doc__.split("\n\n")[1].strip(), "shapes": {s: {} for s in a.shapes.split(",")}}
    for part in a.parts.split(","):  # a part at every shape before the next part: the shapes side by side
        for shape, row in res["shapes"].items():
            row[part] = PARTS[part](shape, a.quick, a.timeout)
            print(f"{shape} {part}: {json.dumps(row[part])[:400]}", flush=True)
            res["wall_s"] = time.time() - t0
            row[part]["meta"] = meta()
            if not a.quick:  # after each part: a run cut short keeps what it measured
                write_json("families.json", _merged(res))
    print(f"\n{'shape':<12} {'train ms':>9} {'MFU':>6} {'gen tok/s':>10} {'of bound':>9} {'exact':>8} {'default':>8}")
    for shape, row in res["shapes"].items():
        t, g, e = row.get("train", {}), row.get("generate", {}), row.get("exact", {})
        print(f"{shape:<12} {t.get('ms', float('nan')):>9.1f} {t.get('mfu', float('nan')):>6.1%} "
              f"{g.get('tok_per_s', float('nan')):>10.0f} {g.get('bound_fraction', float('nan')):>9.1%} "
              f"{e.get('exact', {}).get('exact_frac', float('nan')):>8.2%} "
              f"{e.get('default', {}).get('exact_frac', float('nan')):>8.2%}")
    bad = [s for s, row in res["shapes"].items() for p in row.values() if "error" in p]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
