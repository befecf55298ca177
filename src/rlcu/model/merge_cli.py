"""`rlcu merge BASE ADAPTER OUT`: a base model folder (or Hub id) and a PEFT LoRA folder in, the
merged model out as a full HF folder (the base's tokenizer files along), as PEFT's
merge_and_unload + save_pretrained would write it. The merge runs on the CPU in the weights'
dtype (--dtype; default the base's torch_dtype), each product in fp32 and rounded once."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


def main(argv: list[str]) -> int:
    import torch

    from rlcu.hub import model_folder
    from rlcu.model.causal_lm import CausalLM
    from rlcu.model.lora_peft import load_adapter, save_merged

    p = argparse.ArgumentParser(prog="rlcu merge", description="merge a PEFT LoRA adapter into its base model")
    p.add_argument("base", help="the base model: a folder or a Hub id")
    p.add_argument("adapter", help="a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("out", help="the folder to write the merged model into")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="the weights' dtype (auto: the base's)")
    args = p.parse_args(argv[1:])
    try:
        base = model_folder(args.base)
        name = args.dtype
        if name == "auto":
            d = json.loads((Path(base) / "config.json").read_text())
            name = d.get("torch_dtype") or d.get("dtype") or "float32"
        dtype = getattr(torch, name) if name in DTYPES else torch.float32
        model = CausalLM.from_pretrained(base, dtype=dtype)
        load_adapter(args.adapter, model.cfg, model.device, model.dtype).attach(model)
        save_merged(model, args.out)
    except (OSError, ValueError) as e:
        print(f"rlcu merge: {e}", file=sys.stderr)
        return 2
    print(f"rlcu merge: wrote {args.out} ({model.lora.num_params():,} adapter parameters merged, {name})")
    return 0
