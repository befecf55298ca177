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


TABLES = {"ppo-rm": ppo_rm}
