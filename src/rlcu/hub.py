"""Models and data sets named by a Hugging Face Hub id as well as by a local path.

A path that exists here is read as it is and never needs huggingface_hub or datasets. Any other
name that reads as a Hub id (`org/name`, or a bare `name`; `@revision` may follow: a branch, tag
or commit) is fetched by huggingface_hub and read from its cache: the cache huggingface_hub uses
(HF_HUB_CACHE, HF_HOME), HF_HUB_OFFLINE=1 reads only that cache, a download shows
huggingface_hub's own progress bars, and a model fetches only what rlcu reads (config, safetensors
weights, tokenizer and chat-template files), not the copies of other formats (.bin, onnx/, ...).

Data sets are read by the `datasets` package (an optional extra: pip install 'rlcu[datasets]'):
a Hub id as `datasets.load_dataset(id, subset, split=split)` reads it (so through its own cache),
falling back, when the Hub cannot be reached, to a copy of the data set's repository in the Hub
cache (`hf download --repo-type dataset ID`); a local folder as `Dataset.save_to_disk` wrote it, or
as a folder of data files. Both packages are imported only when a name needs them.

Every error is one line naming the field the name came from (`model.path`, `data.path`, ...)
and its value; all are FileNotFoundError or ValueError, which the commands report as a run that
cannot start (exit status 2).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# what a model fetch takes: rlcu reads config.json, safetensors and fast-tokenizer files only
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "chat_templates/*.jinja")
TOKENIZER_FILES = ("*.json", "*.jinja", "chat_templates/*.jinja")
_NESTED = ("*/*.json", "*/*.safetensors")  # fnmatch's * crosses '/': other formats' sub-folders
_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?")
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
_EXAMPLE = {"model": "Qwen/Qwen3-0.6B", "dataset": "trl-lib/Capybara"}


class MissingPackage(ImportError, ValueError):
    """An optional package that a name needs; a ValueError too, so that the commands report it as
    a setup error (exit status 2) with its one line."""


def _where(field: str | None, name) -> str:
    return f"{field}: {name}" if field else str(name)


def hub_id(name) -> str | None:
    """The repository id of a name that reads as a Hub id (revision dropped), else None."""
    repo = str(name).partition("@")[0]
    if _ID.fullmatch(repo) and ".." not in repo and "--" not in repo and len(repo) <= 96:
        return repo
    return None


def split_revision(name: str, revision: str | None = None, field: str | None = None) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); a revision given apart must agree with it."""
    repo, at, rev = str(name).partition("@")
    if at and not rev:
        raise ValueError(f"{_where(field, name)}: nothing after '@' (give a branch, tag or commit, or drop the '@')")
    if at and revision is not None and rev != revision:
        raise ValueError(f"{_where(field, name)}: names revision {rev!r}, but the revision option says {revision!r}; "
                         "give one")
    return repo, (rev if at else revision)


def offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return True
    import sys

    c = sys.modules.get("huggingface_hub.constants")
    return bool(getattr(c, "HF_HUB_OFFLINE", False))


def need(package: str, what: str, extra: str | None = None):
    """Import a package that only some names need, or one line saying how to install it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        how = f"pip install 'rlcu[{extra}]'" if extra else f"pip install {package}"
        raise MissingPackage(f"{what}: reading it needs the {package} package ({how})") from None


# ---------------------------------------------------------------- models
def model_folder(name, revision: str | None = None, field: str | None = None,
                 files: tuple[str, ...] = MODEL_FILES) -> Path:
    """The local folder of a model: `name` itself when it is a folder here, else the snapshot of
    the Hub repository `name` (at `revision`, or the one after '@') holding `files`."""
    p = Path(str(name)).expanduser()
    if p.is_dir():
        return p
    what = _where(field, name)
    if p.exists():
        raise FileNotFoundError(f"{what}: is a file; give a model folder (config.json, *.safetensors) or a "
                                f"Hugging Face Hub id such as {_EXAMPLE['model']}")
    if hub_id(name) is None:
        raise FileNotFoundError(f"{what}: not a folder; give a model folder or a Hugging Face Hub id such as "
                                f"{_EXAMPLE['model']}")
    repo, rev = split_revision(str(name), revision, field)
    return Path(snapshot(repo, rev, "model", what, files))


def snapshot(repo: str, revision: str | None, kind: str, what: str, files: tuple[str, ...] | None) -> str:
    """huggingface_hub.snapshot_download of `repo` (a `kind`: model or dataset) with every
    failure as one line saying what to do."""
    hf = need("huggingface_hub", what)
    from huggingface_hub.utils import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"@{revision}" if revision else ""
    gone = f"{what}: is not a local path, and"
    try:
        return hf.snapshot_download(repo, repo_type=kind, revision=revision, local_files_only=offline(),
                                    allow_patterns=list(files) if files else None,
                                    ignore_patterns=list(_NESTED) if files else None)
    except GatedRepoError:
        raise FileNotFoundError(f"{what}: the Hugging Face Hub {kind} {repo} is gated: accept its terms on its page "
                                "and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{gone} the Hugging Face Hub has no {kind} {repo} (or it is private: log in with "
                                "hf auth login)") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{what}: the Hugging Face Hub {kind} {repo} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
        get = f"hf download{' --repo-type dataset' if kind == 'dataset' else ''} {repo}"
        raise FileNotFoundError(f"{gone} the {kind} {repo}{at} is not in the Hugging Face cache ({_cache()}) and "
                                f"{why}: fetch it where the Hub is reachable ({get}) and use that cache "
                                "(HF_HOME / HF_HUB_CACHE), or give a local path") from None
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FileNotFoundError(f"{what}: cannot fetch the {kind} {repo}{at} from the Hugging Face Hub: "
                                f"{first}") from None


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


# ---------------------------------------------------------------- data sets
def is_dataset_name(name) -> bool:
    """A data source that is not a data file: an existing folder, or a Hub id that is not here."""
    p = Path(str(name)).expanduser()
    if p.is_dir():
        return True
    return not p.exists() and p.suffix.lower() not in DATA_SUFFIXES and hub_id(name) is not None


def dataset_rows(name, split: str = "train", subset: str | None = None,
                 field: str | None = None) -> list[tuple[str, dict]]:
    """[(location 'NAME[split]:row N', row)] of a dataset folder or a Hub dataset id."""
    what = _where(field, name)
    p = Path(str(name)).expanduser()
    datasets = need("datasets", what, "datasets")
    if p.is_dir():
        ds = _local(datasets, p, split, subset, what)
    else:
        ds = _hub(datasets, str(name), split, subset, field, what)
    return [(f"{name}[{split}]:row {i + 1}", row) for i, row in enumerate(ds.to_list())]


def _local(datasets, p: Path, split: str, subset: str | None, what: str):
    if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():  # Dataset(Dict).save_to_disk
        ds = datasets.load_from_disk(str(p))
        if not isinstance(ds, datasets.DatasetDict):
            return ds
        if split not in ds:
            raise ValueError(f"{what}: has no split {split!r} (splits: {', '.join(ds)}); set data.split")
        return ds[split]
    return _load(datasets, str(p), split, subset, None, what)


def _hub(datasets, name: str, split: str, subset: str | None, field: str | None, what: str):
    repo, rev = split_revision(name, None, field)
    try:
        return _load(datasets, repo, split, subset, rev, what)
    except ConnectionError:  # offline, or no network: the repository's files in the Hub cache
        folder = snapshot(repo, rev, "dataset", what, None)
    return _load(datasets, folder, split, subset, None, what)


def _load(datasets, path: str, split: str, subset: str | None, revision: str | None, what: str):
    from datasets.exceptions import DatasetNotFoundError

    try:
        return datasets.load_dataset(path, subset, split=split, revision=revision)
    except DatasetNotFoundError:
        raise FileNotFoundError(f"{what}: is not a local path, and the Hugging Face Hub has no dataset "
                                f"{path} (or it is private: log in with hf auth login)") from None
    except ConnectionError:
        raise
    except (ValueError, KeyError, OSError) as e:  # an unknown split or subset, a folder of no data files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        opts = f"split {split!r}" + (f", subset {subset!r}" if subset else "")
        raise ValueError(f"{what}: cannot read it as a dataset ({opts}): {first}") from None
