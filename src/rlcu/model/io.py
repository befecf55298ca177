"""Reading and writing HF Qwen3 folders: config.json plus model.safetensors or shards listed
in model.safetensors.index.json. Tensors are copied straight into the flat buffer's views."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlcu.model.config import Qwen3Config
from rlcu.model.layout import ParamLayout

_SHARD_BYTES = 4 * 1024**3


def _tensor_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the file that holds it."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        out = {}
        for name, fname in wm.items():
            p = folder / fname
            if not p.exists():
                raise FileNotFoundError(f"{index} lists {fname} for {name}, but {p} does not exist")
            out[name] = p
        return out
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors")
    out = {}
    for p in files:
        with safe_open(str(p), framework="pt") as f:
            out.update({k: p for k in f.keys()})
    return out


def read_config(folder: str | Path) -> Qwen3Config:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder")
    return Qwen3Config.from_file(folder / "config.json")


def load_into(folder: str | Path, layout: ParamLayout, buf: torch.Tensor) -> None:
    """Fill the flat buffer `buf` from the folder's safetensors, checking every name and shape."""
    folder = Path(folder)
    files = _tensor_files(folder)
    views = layout.hf_views(buf)
    need = set(views)
    # a tied checkpoint may still carry lm_head.weight (equal to the embedding): ignore it
    extra = sorted(k for k in files if k not in views and not (k == "lm_head.weight" and layout.cfg.tie_word_embeddings)
                   and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"{folder}: unexpected tensor(s) for this config: {', '.join(extra[:5])}")
    missing = sorted(need - set(files))
    if missing:
        raise ValueError(f"{folder}: missing tensor(s) {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    by_file: dict[Path, list[str]] = {}
    for name in need:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                want = tuple(views[name].shape)
                if shape != want:
                    raise ValueError(f"{path.name}: tensor {name} has shape {list(shape)}, "
                                     f"config.json implies {list(want)}")
                views[name].copy_(f.get_tensor(name))


def save_folder(folder: str | Path, layout: ParamLayout, buf: torch.Tensor,
                dtype: torch.dtype | None = None, shard_bytes: int = _SHARD_BYTES) -> None:
    """Write an HF folder atomically: into a temp folder beside it, then rename over it."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in layout.hf_views(buf).items()}
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for k, t in tensors.items():
            nb = t.numel() * t.element_size()
            if size and size + nb > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][k] = t
            size += nb
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            wm = {}
            for i, sh in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(sh, str(tmp / fname), metadata={"format": "pt"})
                wm.update({k: fname for k in sh})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
        cfg = layout.cfg.to_hf_dict()
        if dtype is not None:
            cfg["torch_dtype"] = str(dtype).replace("torch.", "")
        else:
            cfg["torch_dtype"] = str(buf.dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for p in tmp.iterdir():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}"
            folder.rename(old)
            tmp.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
