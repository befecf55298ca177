"""The training step replayed as CUDA graphs (train/step_graph.py) against the same step eager,
in one process from the same weights and state (`python bench/train_step.py --graph`).

Arms, each from a snapshot of the initial weights, master and moments, the same batch and lr:
  eager   the library's ordinary step: Qwen3.forward_backward (fused head) or Critic.forward /
          value_loss / backward, then FlatAdamW.step;
  static  StepGraph(graphs=False): the graph's own code (budget-padded buffers, the head over
          every row), run op by op -- what a replay must reproduce bit for bit;
  graph   StepGraph(graphs=True): captured at the first step, replayed after;
  static_again  the static arm once more, untimed in the summary: the step's own run-to-run
          determinism, so that a graph-vs-static difference is told from a nondeterministic
          kernel (it was one: the embedding backward's atomics, now sorted and atomic-free).
Each arm runs warmup + steps optimizer steps (the first graph step captures); the median of the
timed ones is reported, with the losses of every step and the buffers after the last compared.
An arm's peak_GiB leaves out the earlier arms' final buffers, which stay on the device.
"""

from __future__ import annotations

import gc
import time

import torch

ARMS = ("eager", "static", "graph")
RUNS = ARMS + ("static_again",)


def _snapshot(model, opt) -> dict:
    return {"flat": model.flat.clone(), "master": opt.master.clone(), "m": opt.m.clone(), "v": opt.v.clone()}


def _restore(model, opt, snap) -> None:
    model.flat.copy_(snap["flat"])
    if not opt.master_is_model:
        opt.master.copy_(snap["master"])
    opt.m.copy_(snap["m"])
    opt.v.copy_(snap["v"])
    opt.step_count = opt.nonfinite_in_row = opt.skipped_total = 0


def _diff(a: dict, b: dict) -> dict:
    out = {}
    for k in a:
        d = (a[k].float() - b[k].float()).abs()
        out[k] = {"equal": bool(torch.equal(a[k], b[k])), "max_abs": float(d.max()),
                  "rel": float(d.norm() / b[k].float().norm().clamp_min(1e-30))}
    return out


def bench_graph(cfg, B: int, T: int, steps: int, warmup: int, critic: bool = False, ckpt="full") -> dict:
    import rlcu
    from rlcu.config import OptimConfig
    from rlcu.ops.rl_loss import value_loss
    from rlcu.optim import FlatAdamW
    from rlcu.train.critic import Critic
    from rlcu.train.static_batch import pack, slot_bucket
    from rlcu.train.step_graph import StepGraph

    model = rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    model.gradient_checkpointing = ckpt
    if critic:
        model = Critic.from_trunk(model, head_init_std=0.02)
    opt = FlatAdamW(model, OptimConfig(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0))
    N, lr = B * T, 1e-5
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (N,), generator=g)
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32)
    w = torch.full((N,), (1.0 if critic else -1.0) / (N - B))  # d(mean NLL)/d lp, or the value loss's weights
    w[cu[:-1].long()] = 0.0
    packed = pack(tokens, cu, w, N, slot_bucket(B, N))
    if critic:
        v_old, ret = torch.zeros(N), torch.randn(N, generator=g)
        rows = [pack(tokens, cu, x, N, slot_bucket(B, N))["weights"] for x in (v_old, ret)]  # row-aligned
        packed["v_old"], packed["returns"] = rows
        v_old_d, ret_d = v_old.cuda(), ret.cuda()
    tok_d, cu_d, w_d = tokens.cuda(), cu.cuda(), w.cuda()

    def eager_step():
        model.zero_grad()
        if critic:
            v = model.forward(tok_d, cu_d)
            _, dv, st = value_loss(v, v_old_d, ret_d, w_d, clip=0.2)
            model.backward(dv)
            loss = float(st[0])
        else:
            lp = model.forward_backward(tok_d, cu_d, lambda lp_c, ent_c, idx: (w_d[idx], None))
            loss = float((lp * w_d).sum())
        return loss, opt.step(lr, loss)

    snap = _snapshot(model, opt)
    res, finals = {}, {}
    for arm in RUNS:
        _restore(model, opt, snap)
        sg = None if arm == "eager" else StepGraph(model, opt, budget=N, max_seqlen=T, graphs=arm == "graph")
        held = sum(x.numel() * x.element_size() for f in finals.values() for x in f.values())
        step = eager_step if sg is None else (lambda sg=sg: sg.step([packed], lr))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        losses, times, infos = [], [], []
        for i in range(warmup + steps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            s.record()
            loss, info = step()
            e.record()
            torch.cuda.synchronize()
            losses.append(loss)
            infos.append(info)
            if i >= warmup:
                times.append(s.elapsed_time(e))
            elif i == 0:
                first_s = time.perf_counter() - t0
        times.sort()
        res[arm] = {"ms": times[len(times) // 2], "ms_min": times[0], "first_step_s": first_s, "losses": losses,
                    "grad_norms": [i["grad_norm"] for i in infos],
                    "peak_GiB": (torch.cuda.max_memory_allocated() - held) / 2**30}
        if sg is not None:
            res[arm]["captures"] = sg.captures
        finals[arm] = _snapshot(model, opt)
        sg = step = None
        gc.collect()
        torch.cuda.empty_cache()
    res["graph_vs_static"] = {"losses_equal": res["graph"]["losses"] == res["static"]["losses"],
                              "grad_norms_equal": res["graph"]["grad_norms"] == res["static"]["grad_norms"],
                              "state": _diff(finals["graph"], finals["static"])}
    res["static_vs_static"] = {"losses_equal": res["static_again"]["losses"] == res["static"]["losses"],
                               "state": _diff(finals["static_again"], finals["static"])}
    res["eager_vs_static"] = {"loss_max_rel": max(abs(a - b) / max(abs(b), 1e-30) for a, b in
                                                  zip(res["eager"]["losses"], res["static"]["losses"])),
                              "state": _diff(finals["eager"], finals["static"])}
    for arm in ("eager", "static"):
        res[f"speedup_graph_vs_{arm}"] = res[arm]["ms"] / res["graph"]["ms"]
    return res
