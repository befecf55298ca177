"""Reading and writing HF model folders (any family of model/family.py): config.json plus
model.safetensors or shards listed in model.safetensors.index.json. Tensors are copied straight
into the flat buffer's views (`load_flat` makes one for a folder; `random_flat` one drawn as HF
initialises); a save copies the tokenizer's and generation files of the folder the model came
from (`copy_side_files`).

Qwen3-MoE's experts are written one tensor an expert and matrix (`mlp.experts.{e}.gate_proj.weight`,
as transformers 5 still writes them and the published checkpoints hold); either that form or
transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj` is read (model/layout.py
`file_views`).

Loading names the file of every problem: a file that is not valid safetensors (truncated,
corrupted), a tensor of the wrong shape, a missing or unexpected tensor, and a tensor holding
nan or inf (refused: training from it would only spread them). Saving replaces the files it
writes one by one, atomically (temp file, fsync, rename), with the mode the umask asks for,
and touches nothing else in the folder.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlcu.files import atomic_write
from rlcu.model.config import Qwen3Config
from rlcu.model.layout import ParamLayout

_SHARD_BYTES = 4 * 1024**3
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _tensor_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the file that holds it."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        out = {}
        for name, fname in wm.items():
            p = folder / fname
            if not p.exists():
                raise FileNotFoundError(f"{index} lists {fname} for {name}, but {p} does not exist")
            out[name] = p
        return out
    if single.exists():
        return dict.fromkeys(_names(single), single)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors")
    out = {}
    for p in files:
        out.update(dict.fromkeys(_names(p), p))
    return out


def _bad_file(path: Path, e: BaseException) -> ValueError:
    return ValueError(f"{path}: not a valid safetensors file ({type(e).__name__}: {e}); "
                      f"it may be truncated or corrupted: download or save it again")


def _names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise _bad_file(path, e) from None


def read_config(folder: str | Path) -> Qwen3Config:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder")
    return Qwen3Config.from_file(folder / "config.json")


def load_into(folder: str | Path, layout: ParamLayout, buf: torch.Tensor, skip: frozenset[str] = frozenset()) -> None:
    """Fill the flat buffer `buf` from the folder's safetensors, checking every name and shape.
    skip: names the folder may hold beside the layout's, read by the caller (a reward model's
    `score.weight`)."""
    folder = Path(folder)
    files = _tensor_files(folder)
    views = layout.file_views(buf, fused=frozenset(k for k in files if k.endswith(("experts.gate_up_proj",
                                                                                   "experts.down_proj"))))
    need = set(views)
    # a tied checkpoint may still carry lm_head.weight (equal to the embedding): ignore it
    extra = sorted(k for k in files if k not in views and k not in skip
                   and not (k == "lm_head.weight" and layout.cfg.tie_word_embeddings)
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
        try:
            f = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as e:
            raise _bad_file(path, e) from None
        with f:
            for name in sorted(names):
                try:
                    shape = tuple(f.get_slice(name).get_shape())
                    want = tuple(views[name].shape)
                    if shape != want:
                        raise ValueError(f"{path.name}: tensor {name} has shape {list(shape)}, "
                                         f"config.json implies {list(want)}")
                    t = f.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise _bad_file(path, e) from None
                views[name].copy_(t)
                _check_finite(views[name], name, path)


def _check_finite(v: torch.Tensor, name: str, path: Path) -> None:
    if v.is_floating_point() and not bool(torch.isfinite(v).all()):
        n_nan, n_inf = int(torch.isnan(v).sum()), int(torch.isinf(v).sum())
        raise ValueError(f"{path}: tensor {name} holds {n_nan} nan and {n_inf} inf value(s) "
                         f"(as {str(v.dtype).replace('torch.', '')}); refusing to load non-finite weights")


def save_folder(folder: str | Path, layout: ParamLayout, buf: torch.Tensor,
                dtype: torch.dtype | None = None, shard_bytes: int = _SHARD_BYTES,
                extra: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> None:
    """Write the weights and config.json of an HF folder into `folder`, each file atomically
    (see atomic_write); other files there (a tokenizer) are left alone. The weight files of
    an earlier save in the other layout (single file vs shards) are removed once the new
    ones are in place, so that a loader cannot pick up stale weights. extra: tensors written
    beside the layout's (a reward model's score head); config: the config.json dict to write in
    place of the layout's own."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    views = {**layout.file_views(buf), **(extra or {})}
    tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in views.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nb = t.numel() * t.element_size()
        if size and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nb
    old = _weight_files(folder)
    written: set[str] = set()
    if len(shards) == 1:
        atomic_write(folder / "model.safetensors",
                     lambda p: save_file(shards[0], str(p), metadata={"format": "pt"}))
        written.add("model.safetensors")
    else:
        wm = {}
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            atomic_write(folder / fname, lambda p, sh=sh: save_file(sh, str(p), metadata={"format": "pt"}))
            wm.update({k: fname for k in sh})
            written.add(fname)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2)
        atomic_write(folder / "model.safetensors.index.json", lambda p: p.write_text(index))
        written.add("model.safetensors.index.json")
    # the index decides which files a loader reads: drop a stale one first, then its shards
    for name in sorted(old - written, key=lambda n: not n.endswith(".index.json")):
        (folder / name).unlink(missing_ok=True)
    cfg = dict(config) if config is not None else layout.cfg.to_hf_dict()
    cfg["torch_dtype"] = str(dtype if dtype is not None else buf.dtype).replace("torch.", "")
    text = json.dumps(cfg, indent=2)
    atomic_write(folder / "config.json", lambda p: p.write_text(text))


def _weight_files(folder: Path) -> set[str]:
    """The weight files of an earlier save in `folder`: model.safetensors, the index and the
    shards it lists (only names of ours, never other files)."""
    out = {n for n in ("model.safetensors", "model.safetensors.index.json") if (folder / n).is_file()}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            out |= {str(f) for f in json.loads(index.read_text()).get("weight_map", {}).values()
                    if _SHARD_RE.fullmatch(str(f))}
        except (json.JSONDecodeError, AttributeError, OSError):
            pass
    return {n for n in out if (folder / n).is_file()}


# files copied along when a model loaded from a folder is saved to another
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def load_flat(folder: str | Path, device, dtype: torch.dtype) -> tuple[Qwen3Config, torch.Tensor]:
    """A folder's config and its weights in a new flat buffer of `dtype` on `device` (the
    alignment padding zero)."""
    cfg = read_config(folder)
    layout = ParamLayout(cfg)
    flat = layout.empty(device, dtype)
    flat.zero_()
    load_into(folder, layout, flat)
    return cfg, flat


def random_flat(cfg: Qwen3Config, device, dtype: torch.dtype, seed: int, init_std: float) -> torch.Tensor:
    """A flat buffer initialised as HF does: N(0, init_std) matrices, unit norms; drawn from a
    CPU generator in fp32 (the same weights on any device), then cast to `dtype`."""
    layout = ParamLayout(cfg)
    flat = torch.zeros(layout.numel, device=device, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, v in layout.views(flat).items():
        if name.endswith("norm"):
            v.fill_(1.0)
        else:
            v.copy_(torch.randn(v.shape, generator=gen) * init_std)
    return flat.to(dtype)


def copy_side_files(source: str | Path, folder: str | Path) -> None:
    """The tokenizer's and generation files (`SIDE_FILES`) of `source` copied into `folder` where
    it has none, each atomically; nothing when the two are one folder."""
    source, folder = Path(source), Path(folder)
    if source.resolve() == folder.resolve():
        return
    for name in SIDE_FILES:
        src, dst = source / name, folder / name
        if src.is_file() and not dst.exists():
            atomic_write(dst, lambda p, src=src: shutil.copyfile(src, p))
