"""The one figure of bench/learning.py: per task (a row), the training reward per mode (mean over
seeds, band min..max), the held-out greedy accuracy before and after (bars, mean over seeds, the
seeds as dots) and rlcu's mismatch mean |lp_train - lp_engine| per step (symlog, so that exact
mode's zeros sit on the axis's floor, labelled)."""

from __future__ import annotations

from pathlib import Path

COLORS = {"default": "tab:blue", "tis": "tab:green", "recompute": "tab:purple", "exact": "tab:red",
          "trl": "tab:orange"}


def _mean_band(curves: list[list[float]]):
    n = min(len(c) for c in curves)
    cols = [[c[i] for c in curves] for i in range(n)]
    return [sum(x) / len(x) for x in cols], [min(x) for x in cols], [max(x) for x in cols]


def _curves(runs, task, mode, key=None):
    out = []
    for r in runs:
        if r["task"] != task or r["mode"] != mode or "reward" not in r:
            continue
        if key is None:
            out.append(r["reward"])
        elif r.get("mismatch") and all(v is not None for v in r["mismatch"][key]):
            out.append(r["mismatch"][key])
    return [c for c in out if c]


def _reward(ax, runs, task, modes):
    for m in modes:
        cs = _curves(runs, task, m)
        if not cs:
            continue
        mean, lo, hi = _mean_band(cs)
        x = range(1, len(mean) + 1)
        ax.fill_between(x, lo, hi, color=COLORS[m], alpha=0.15, lw=0)
        ax.plot(x, mean, color=COLORS[m], lw=1.8, label=f"{m} ({len(cs)})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("training reward (exact match, T=1)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", title="mode (seeds)", title_fontsize=7)


def _accuracy(ax, runs, sfts, task, modes):
    before = [s["accuracy_before"] for s in sfts if s["task"] == task]
    bars = [("SFT", before, "tab:gray")]
    bars += [(m, [r["accuracy_after"] for r in runs if r["task"] == task and r["mode"] == m and "accuracy_after" in r],
              COLORS[m]) for m in modes]
    for i, (_, vals, color) in enumerate(bars):
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        ax.bar(i, mean, color=color, alpha=0.8)
        ax.plot([i] * len(vals), vals, "k.", ms=4)
        ax.text(i, mean + 0.02, f"{mean:.2f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, fontsize=7)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3, axis="y")


def _mismatch(ax, runs, task, modes):
    pos = [v for m in modes for c in _curves(runs, task, m, "mismatch/abs_mean") for v in c if v > 0]
    floor = min(pos) / 10 if pos else 1e-8
    for m in modes:
        cs = _curves(runs, task, m, "mismatch/abs_mean")
        if not cs:
            continue
        mean, lo, hi = _mean_band(cs)
        fr = _curves(runs, task, m, "mismatch/exact_frac")
        exact = sum(sum(c) / len(c) for c in fr) / len(fr) if fr else float("nan")
        x = range(1, len(mean) + 1)
        ax.fill_between(x, lo, hi, color=COLORS[m], alpha=0.15, lw=0)
        lbl = f"{m}: {exact:.0%} tokens bit-equal"
        if max(hi) == 0:
            lbl = f"{m}: 0 at every step ({exact:.0%} bit-equal)"
        ax.plot(x, mean, color=COLORS[m], lw=1.8, label=lbl)
    ax.set_yscale("symlog", linthresh=floor)
    ax.set_ylim(0, max(pos) * 10 if pos else 1.0)  # headroom above the curves for the legend
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mismatch: mean |lp_train - lp_engine|")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    ax.text(0.01, 0.01, "TRL: no such metric without vLLM", transform=ax.transAxes, fontsize=6, color="gray")


def plot(runs: list[dict], sfts: list[dict], tasks: list[str], modes: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 4.2 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        _reward(row[0], runs, task, modes)
        row[0].set_title(f"{task}: training reward (mean over seeds, band min..max)", fontsize=9)
        _accuracy(row[1], runs, sfts, task, modes)
        row[1].set_title(f"{task}: held-out accuracy, before and after GRPO", fontsize=9)
        _mismatch(row[2], runs, task, [m for m in modes if m != "trl"])
        row[2].set_title(f"{task}: train/inference mismatch (rlcu)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
