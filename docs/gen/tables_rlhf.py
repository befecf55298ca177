"""The benchmark tables of the RLHF loop with learned models (reward models, DPO, PPO's four models),
rendered at build time from bench/results as bench_tables' others."""

from __future__ import annotations

from results import _table, load, source


def ppo_rm() -> str:
    rows = []
    for name, label in (("ppo_rm.json", "kept on the device"), ("ppo_rm_offload.json", "offloaded between scorings")):
        d = load(name)
        r, p = d["rlcu"], d["rlcu"]["phases_s"]
        rows.append([label, f"{r['s_per_step']:.2f}", f"{p['rollout']:.2f} ({r['reward_model_s']:.2f})",
                     f"{p['ref_logprobs']:.2f}", f"{p['critic_values']:.2f}", f"{p['actor_train']:.2f}",
                     f"{p['critic_train']:.2f}", f"{r['peak_GiB']:.1f} ({r['estimate_peak_GiB']:.1f})",
                     source(name, d)])
        t = d.get("trl", {})
        if "s_per_step" in t:  # the peer, where it ran (TRL 1.12's PPOTrainer: TRL 1.13 removed it)
            peak = f"{t['peak_GiB']:.1f}" if "peak_GiB" in t else "-"
            rows.append([f"TRL {t['trl']} PPOTrainer (the peer)", f"{t['s_per_step']:.2f}", "-", "-", "-", "-", "-",
                         peak, source(name, d)])
    return _table(["reward model", "s/step", "rollout (of it: scoring)", "ref logprobs", "critic values",
                   "actor train", "critic train", "peak GiB (estimate)", "file, tree, device"], rows)


def preference() -> str:
    """Reward-model and DPO steps beside TRL's trainers: each shape's two sides ran in one call."""
    rows = []
    for name, what, peer in (("reward_model.json", "reward model", "RewardTrainer"), ("dpo.json", "DPO", "DPOTrainer")):
        d = load(name)
        for shape in ("0.6b", "4b"):
            sides = d.get(shape, {})
            r, t = sides.get("rlcu", {}), sides.get("trl", {})
            for side, row, label in (("rlcu", r, "rlcu"), ("trl", t, f"TRL {peer}")):
                if "s_per_step" not in row:
                    rows.append([f"{what}, {shape.upper()}", label, f"not measured: {str(row.get('error', '-'))[:60]}",
                                 "", "", "", "", source(name, d)])
                    continue
                ratio = f"{t['s_per_step'] / r['s_per_step']:.2f}x" if side == "rlcu" and "s_per_step" in t else ""
                ref = f"{row['ref_s']:.1f}" if "ref_s" in row else "-"
                rows.append([f"{what}, {shape.upper()}", label, f"{row['s_per_step']:.3f}", f"{row['pairs_per_s']:.1f}",
                             f"{row['peak_GiB']:.1f}", ref, ratio, source(name, d)])
    return _table(["step", "side", "s/step", "pairs/s", "peak GiB", "reference logprobs s", "speed vs TRL",
                   "file, tree, device"], rows)


TABLES = {"ppo-rm": ppo_rm, "preference": preference}
