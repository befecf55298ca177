"""The DPO reference file (rlcu.train.dpo_ref): its fingerprint moves with any pair's token, the
set a pair is in, the reference's source and its weights; a file is read back only under its own
fingerprint; the pass over the pairs equals each pair's sequences summed alone."""

import torch
from support.trainers import tiny

from rlcu.train import dpo_ref


def test_fingerprint_store_and_pass(tmp_path):
    m = tiny()
    sets = {"train": [([1, 2], [3, 4], [5]), ([6], [7], [8, 9])], "eval": [([1], [2], [3])]}
    fp = dpo_ref.fingerprint(sets, "initial policy", m)
    assert fp == dpo_ref.fingerprint({k: [tuple(list(x) for x in p) for p in v] for k, v in sets.items()},
                                     "initial policy", m)
    moved = {"train": [([1, 2], [3, 4], [5]), ([6], [7], [8, 10])], "eval": sets["eval"]}
    swapped = {"train": sets["train"][:1], "eval": sets["eval"] + sets["train"][1:]}
    other = tiny(seed=1)
    assert len({fp, dpo_ref.fingerprint(moved, "initial policy", m), dpo_ref.fingerprint(swapped, "initial policy", m),
                dpo_ref.fingerprint(sets, "ref_model:x", m), dpo_ref.fingerprint(sets, "initial policy", other)}) == 5
    got = dpo_ref.compute(m, sets, budget=8)  # micro-batches of at most 8 tokens: one pair each
    for name, pairs in sets.items():
        for k, (p, c, r) in enumerate(pairs):
            for j, comp in enumerate((c, r)):
                ids = torch.tensor(p + comp)
                lp = m.forward(ids, torch.tensor([0, len(ids)], dtype=torch.int32), grad=False)
                assert torch.allclose(got[name][k, j], lp[len(p):].double().sum(), atol=1e-6)
    path = tmp_path / dpo_ref.FILE
    dpo_ref.save(path, fp, got)
    back = dpo_ref.load(path, fp)
    assert back is not None and all(torch.equal(back[k], got[k]) for k in got)
    assert dpo_ref.load(path, "another") is None and dpo_ref.load(tmp_path / "none.pt", fp) is None
    path.write_bytes(b"not a checkpoint")
    assert dpo_ref.load(path, fp) is None
