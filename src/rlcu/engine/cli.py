"""`rlcu generate`: prompts JSONL in, completions JSONL out, with a progress bar in tokens/s.

Each input line is {"prompt": "text"}, {"prompt": [{"role": ..., "content": ...}, ...]} (a
chat, rendered with the model's chat template) or {"prompt_token_ids": [...]}. Each output
line is {"index", "prompt", "num_prompt_tokens", "outputs": [{"text", "token_ids",
"finish_reason", "logprobs"?}]} in input order; a request refused at submission (an empty
prompt, one too long, an unknown token id) is written as {"index", "error"}, named on stderr
by file and line, and the command exits with 1 after generating the others. A malformed line
stops everything before the model is loaded (exit 2).

`--lora PATH` applies a PEFT LoRA adapter folder to every request, unmerged (engine/lora.py);
one that does not fit the model is refused by name before anything runs (exit 2).

`--model tiny` (the default) builds a tiny random Qwen3 and a word-level tokenizer: a smoke
run of the whole path without any download.
"""

from __future__ import annotations

import argparse
import json
import sys

from rlcu.errors import NO_SPACE_STATUS, no_space
from rlcu.threads import apply, parse_setting

_TINY_WORDS = ("the a an and or but if then else of to in on at for with from by is are was were be been "
               "it this that these those i you he she we they me him her us them my your his its our their "
               "what which who when where why how all any some no not yes one two three four five six seven "
               "eight nine ten add sum number answer question think step so because solve find value "
               "0 1 2 3 4 5 6 7 8 9 . , ? ! : ; = + - * /").split()
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
_TINY_PROMPTS = ["what is two add three ?", "the answer is", "think step by step : find the sum of 4 and 5"]


def tiny_model_and_tokenizer(device=None, seed: int = 0):
    """A random 2-layer Qwen3 over a ~100-word vocabulary, and its word tokenizer."""
    import torch

    from rlcu.data.tokenizer import make_word_tokenizer
    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config

    tok = make_word_tokenizer(_TINY_WORDS, _TINY_SPECIALS, chat_template=_TINY_TEMPLATE)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return Qwen3.from_config(cfg, device=dev, dtype=dtype, seed=seed, init_std=0.5), tok


def read_prompts(path: str) -> list[tuple[int, object]]:
    """(line number, prompt) per non-blank line; ValueError naming file and line if malformed."""
    from rlcu.data.datasets import jsonl_rows
    from rlcu.engine.requests import token_ids

    try:
        fh = sys.stdin.buffer if path == "-" else open(path, "rb")  # bytes: a non-UTF-8 line is named
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    with fh:
        rows = jsonl_rows(fh, path)
    out = []
    for no, rec in rows:
        if "prompt_token_ids" in rec:
            ids = rec["prompt_token_ids"]
            if not isinstance(ids, list) or token_ids(ids) is None:
                raise ValueError(f'{path}:{no}: "prompt_token_ids" must be a list of integers')
            out.append((no, {"prompt_token_ids": ids}))
            continue
        if "prompt" not in rec:
            raise ValueError(f'{path}:{no}: expected an object with "prompt" (text or chat messages) '
                             f'or "prompt_token_ids" (a list of ints)')
        p = rec["prompt"]
        chat = isinstance(p, list) and all(isinstance(m, dict) and "role" in m for m in p)
        if not (isinstance(p, str) or chat):
            raise ValueError(f'{path}:{no}: "prompt" must be a string or a list of {{"role", "content"}} messages')
        out.append((no, p))
    return out


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help, except where the help says what "unset" means (None,
    an empty string) and for on/off flags (off unless given)."""

    def _get_help_string(self, action):
        d = action.default
        if d is None or d is False or d == "" or d is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlcu generate", description="Prompts JSONL in, completions JSONL out.",
                                formatter_class=_HelpFormatter)
    p.add_argument("--model", default="tiny", help="model folder or Hugging Face Hub id (e.g. Qwen/Qwen3-0.6B, "
                                                   "ID@revision), or 'tiny' for a random smoke-test model")
    p.add_argument("--input", help="prompts JSONL ('-' for stdin); unset with --model tiny: three built-in prompts")
    p.add_argument("--output", default="-", help="completions JSONL ('-': stdout)")
    p.add_argument("--lora", default=None, help="a PEFT LoRA adapter folder (adapter_config.json + "
                                                "adapter_model.safetensors) applied to every request (unset: none)")
    s = p.add_argument_group("sampling")
    s.add_argument("--n", type=int, default=1, help="completions per prompt (they share the prompt's KV cache)")
    s.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens whose "
                                                             "probability reaches top-p")
    s.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (<= 0: all)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times the top probability")
    s.add_argument("--max-tokens", type=int, default=256, help="most new tokens per completion")
    s.add_argument("--seed", type=int, default=None, help="per-request seed (unset: drawn from torch's generator)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the model's EOS")
    s.add_argument("--stop-token-ids", default="", help="comma-separated token ids that end a completion "
                                                         "(unset: none)")
    s.add_argument("--logprobs", action="store_true", help="write the logprob of each sampled token")
    s.add_argument("--chat-template-kwargs", default=None,
                   help='JSON template variables, e.g. {"enable_thinking": false} (unset: none)')
    e = p.add_argument_group("engine")
    e.add_argument("--device", default=None, help="cpu or cuda (unset: cuda when available)")
    e.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on the CPU), float32 or "
                                                   "bfloat16")
    e.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one engine step")
    e.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per engine step (the chunked-prefill budget)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                   help="fraction of the device's memory the process may use, the KV pool included")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block, a power of two "
                                                                "(unset: 16)")
    e.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks, overriding --gpu-memory-utilization (unset: sized from it; on the CPU: "
                        "4 sequences of max-model-len, at most 1 GiB)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (unset: the model's max_position_embeddings, lowered to what the pool "
                        "holds)")
    e.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    e.add_argument("--exact", action="store_true",
                   help="exact on-policy mode: batch-invariant kernels, so a request's tokens and logprobs do not "
                        "depend on the batch it runs in and equal the trainer's forward (docs/exact.md)")
    e.add_argument("--no-prefill-graphs", action="store_true",
                   help="run prefill and mixed steps eagerly (decode steps keep their graphs; saves about one "
                        "full-budget step's activations)")
    e.add_argument("--no-warmup", action="store_true", help="compile kernels and capture graphs on first use, not "
                                                            "at the engine's start")
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e.add_argument("--threads", default="auto", help="torch CPU threads: a number, or auto (OMP_NUM_THREADS when "
                                                     "set, else the cores this process may use, at most those idle "
                                                     "at the start; rlcu.threads)")
    return p


def _fail(msg: str, code: int = 2) -> int:
    print(f"rlcu generate: {msg}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "generate":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    tiny = args.model in (None, "", "tiny")
    try:
        if args.input is None:
            if not tiny:
                return _fail("--input is required with a model folder")
            lines = list(enumerate(_TINY_PROMPTS, 1))
        else:
            lines = read_prompts(args.input)
        stop = [int(t) for t in args.stop_token_ids.split(",") if t.strip()]
        kw = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
        if args.device is not None:  # one line, not torch's traceback, for a device this machine lacks
            from rlcu.config import check_device

            check_device(args.device, "--device")
        if args.output != "-":
            _check_output(args.output)  # before the model loads and generates
        threads = parse_setting(args.threads, "--threads")
    except ValueError as e:
        return _fail(str(e))
    apply(threads)  # before any work: torch's default counts every core of the machine

    from rlcu.engine import LLM, SamplingParams

    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, max_tokens=args.max_tokens, stop_token_ids=stop,
                                ignore_eos=args.ignore_eos, seed=args.seed, logprobs=args.logprobs)
        engine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                      num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
                      enforce_eager=args.enforce_eager, warmup=False if args.no_warmup else None,
                      prefill_graphs=not args.no_prefill_graphs, exact=args.exact)
        if tiny:
            model, tok = tiny_model_and_tokenizer(args.device)
            llm = LLM(model, tokenizer=tok, lora=args.lora, **engine)
        else:
            from rlcu.hub import model_folder

            llm = LLM(model_folder(args.model, field="--model"), device=args.device, dtype=args.dtype,
                      lora=args.lora, **engine)
    except (ValueError, FileNotFoundError) as e:
        return _fail(f"--lora: {e}" if args.lora and "LLM.lora" in str(e) else str(e))

    src = args.input or "<built-in prompts>"
    prompts, chat_errors = [], {}
    for i, (_, p) in enumerate(lines):
        if isinstance(p, list):  # a chat: render it here so that a template error names its line
            try:
                p = {"prompt_token_ids": list(llm.tokenizer.apply_chat_template(p, add_generation_prompt=True,
                                                                                tokenize=True, **kw))}
            except (ValueError, TypeError, KeyError) as e:
                chat_errors[i] = f"chat template failed: {e}"
                p = {"prompt_token_ids": []}
        prompts.append(p)
    try:
        outs = llm.generate(prompts, params, use_tqdm=not args.no_progress, on_error="return")
    except ValueError as e:
        return _fail(str(e))

    try:
        n_err = _write_outputs(args.output, lines, outs, chat_errors, src)
    except OSError as e:  # a full disk: one line and the trainers' status for it, not a traceback
        full = no_space(e)
        return _fail(f"--output {args.output}: {'no space left on device' if full else e.strerror or e}",
                     NO_SPACE_STATUS if full else 2)
    st = llm.stats
    print(f"rlcu generate: {len(outs) - n_err} requests, {st.get('output_tokens', 0)} tokens in "
          f"{st.get('wall', 0.0):.2f} s ({st.get('output_tokens', 0) / max(st.get('wall', 0.0), 1e-9):,.0f} tok/s)",
          file=sys.stderr)
    return 1 if n_err else 0


def _check_output(path: str) -> None:
    """--output names a file this process may write, in a folder that exists (ValueError)."""
    import os
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"--output {path} is a folder: give a file, or - for stdout")
    if not p.parent.is_dir():
        raise ValueError(f"--output {path}: {p.parent} is not a folder")
    if not os.access(p if p.exists() else p.parent, os.W_OK):
        raise ValueError(f"--output {path}: permission denied")


def _write_outputs(output: str, lines, outs, chat_errors: dict, src: str) -> int:
    """One JSON line per request into `output` (- for stdout); returns the requests in error."""
    n_err = 0
    out_fh = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")
    with out_fh if out_fh is not sys.stdout else _nullcontext():
        for i, ((no, p), o) in enumerate(zip(lines, outs)):
            err = chat_errors.get(i, o.error)
            if err is not None:
                n_err += 1
                print(f"rlcu generate: {src}:{no}: {err}", file=sys.stderr)
                out_fh.write(json.dumps({"index": i, "error": err}) + "\n")
                continue
            rec = {"index": i, "prompt": p if not isinstance(p, dict) else None,
                   "num_prompt_tokens": len(o.prompt_token_ids),
                   "outputs": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                **({"logprobs": c.logprobs} if c.logprobs is not None else {})} for c in o.outputs]}
            out_fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return n_err


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
