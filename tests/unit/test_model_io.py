"""Weights I/O: save_pretrained replaces only its own files, each atomically, with the umask's
modes; a full disk says so with the path and leaves the old files; a corrupted safetensors
file, and nan / inf weights, are refused at load with the path (and the tensor's name)."""

import errno
import os
import stat

import pytest
import torch

import rlcu
from rlcu.model import io
from rlcu.model.config import Qwen3Config

CFG = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64)


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _model(seed=0):
    return rlcu.Qwen3.from_config(CFG, seed=seed)


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_save_keeps_other_files_and_follows_umask(tmp_path, umask022):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"a tokenizer": true}')
    (out / "notes.txt").write_text("mine")
    m = _model()
    m.save_pretrained(out)
    assert (out / "tokenizer.json").read_text() == '{"a tokenizer": true}' and (out / "notes.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt",
                                                     "tokenizer.json"]  # no temp files left
    assert torch.equal(rlcu.Qwen3.from_pretrained(out).flat, m.flat)
    for name in ("model.safetensors", "config.json"):
        assert _mode(out / name) == 0o644, name
    os.umask(0o002)
    fresh = tmp_path / "a" / "b"
    m.save_pretrained(fresh)
    assert _mode(fresh) == 0o775 and _mode(fresh / "model.safetensors") == 0o664


def test_resave_other_layout_drops_stale_weights(tmp_path):
    out = tmp_path / "m"
    a, b = _model(0), _model(1)
    io.save_folder(out, a.layout, a.flat, shard_bytes=2_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    (out / "tokenizer_config.json").write_text("{}")
    b.save_pretrained(out)  # one file now: the index and the shards of the first save would win
    assert not (out / "model.safetensors.index.json").exists() and not any(p.exists() for p in shards)
    assert (out / "tokenizer_config.json").exists()
    assert torch.equal(rlcu.Qwen3.from_pretrained(out).flat, b.flat)
    io.save_folder(out, a.layout, a.flat, shard_bytes=2_000)  # and back: the single file goes
    assert not (out / "model.safetensors").exists()
    assert torch.equal(rlcu.Qwen3.from_pretrained(out).flat, a.flat)


def test_disk_full_names_the_path_and_keeps_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "m"
    _model(0).save_pretrained(out)
    before = (out / "model.safetensors").read_bytes()

    def full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io, "save_file", full)
    with pytest.raises(OSError, match=r"no space left on device while writing .*m/model\.safetensors") as ei:
        _model(1).save_pretrained(out)
    assert ei.value.errno == errno.ENOSPC
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    def full_rust(tensors, path, metadata=None):  # how safetensors reports it
        raise io.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                 'message: "No space left on device" })')

    monkeypatch.setattr(io, "save_file", full_rust)
    with pytest.raises(OSError, match="no space left on device while writing"):
        _model(1).save_pretrained(out)


def test_corrupted_safetensors_names_the_file(tmp_path):
    out = tmp_path / "m"
    _model().save_pretrained(out)
    f = out / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match=rf"{f}: not a valid safetensors file"):
        rlcu.Qwen3.from_pretrained(out)
    f.write_bytes(b"\xff" * 64)  # garbage header
    with pytest.raises(ValueError, match=rf"{f}: not a valid safetensors file.*corrupted"):
        rlcu.Qwen3.from_pretrained(out)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    _model().save_pretrained(out)
    t = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    t[name][3, 5] = bad
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor {name} holds .*refusing to load non-finite"):
        rlcu.Qwen3.from_pretrained(out)


def test_tokenizer_save_is_atomic_and_names_a_full_disk(tmp_path, monkeypatch, umask022):
    from rlcu.data import synthetic as syn

    tok = syn.make_tokenizer()
    out = tmp_path / "tok"
    tok.save_pretrained(out)
    assert _mode(out / "tokenizer.json") == 0o644
    before = (out / "tokenizer_config.json").read_bytes()

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(out), "write_text", full)
    with pytest.raises(OSError, match=r"no space left on device while writing .*tok/tokenizer_config\.json"):
        tok.save_pretrained(out)
    monkeypatch.undo()
    assert (out / "tokenizer_config.json").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_hidden_disk_full_is_named(tmp_path, monkeypatch):
    """torch.save reports a full disk as 'unexpected pos ...': the free space decides."""
    import collections
    import shutil

    def torch_like(p):
        p.write_bytes(b"x" * 10)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 832 vs 726")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 << 20, 100 << 20, 0))
    with pytest.raises(OSError, match=r"no space left on device while writing .*optim\.pt"):
        io.atomic_write(tmp_path / "optim.pt", torch_like)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 << 30, 1 << 30, 99 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # not a full disk: the error as it was
        io.atomic_write(tmp_path / "optim.pt", torch_like)
