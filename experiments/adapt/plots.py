"""The adaptation study's plots (:mod:`.adapt_report` writes them):

* ``adapt_frontier.png``: seed-mean exact match against batch-1 tokens/s, one panel per arm that trains every
  method (the baseline, the recommended recipe), one curve per method and commit rule, the seeds' sd as error bars,
  the pretrained AR on the plain prompt as a line;
* ``adapt_levers.png``: the lever model (SetDLM) of every arm, exact match against tokens/s (W = D), one curve per
  arm and commit rule, with the baseline arm's AR fine-tune as a star;
* ``adapt_tau.png``: exact match against tau (log scale, 1e6 = one token per step) for every arm's SetDLM at W = D,
  one panel per commit rule (the collapse of the confidence rule, and whether the leftmost rule avoids it);
* ``adapt_curves.png``: validation loss against step of every fine-tune of the first seed.
"""
from __future__ import annotations

from pathlib import Path

from experiments.paper import frontier as F
from experiments.paper.report import _plt
from setdiff_mega import methods

STYLE = {"confidence": "o-", "leftmost": "s--"}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_frontier(means: list[dict], arms: list[tuple[str, str]], path: Path) -> Path:
    """``arms``: (name, label) of the arms with every method."""
    plt = _plt()
    fig, axes = plt.subplots(1, max(len(arms), 1), figsize=(5.8 * max(len(arms), 1), 4.4), dpi=120, squeeze=False,
                             sharey=True)
    ref = [p for p in means if p["arm"] == "pretrained"]
    for ax, (arm, label) in zip(axes[0], arms):
        sel = [p for p in means if p["arm"] == arm]
        for key in dict.fromkeys((p["method"], p["rule"]) for p in sel):
            pts = sorted((p for p in sel if (p["method"], p["rule"]) == key), key=lambda p: p["tokens_per_s"])
            causal = methods.get(pts[0]["objective"]).causal
            ax.errorbar([p["tokens_per_s"] for p in pts], [p["accuracy"] for p in pts],
                        yerr=[p.get("accuracy_sd") or 0.0 for p in pts], fmt="*" if causal else STYLE[key[1]],
                        ms=9 if causal else 4, lw=1.1, capsize=2, label=key[0] if causal else f"{key[0]}, {key[1]}")
        if ref:
            ax.axhline(ref[0]["accuracy"], color="gray", ls=":", lw=1, label="pretrained AR, plain prompt")
        ax.set_title(label)
        ax.set_xlabel("decoding tokens/s (batch 1)")
        ax.set_ylabel("held-out exact match (chat prompt)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return _save(fig, path)


def plot_levers(means: list[dict], lever_model: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    obj, D = lever_model["objective"], lever_model.get("D")
    sel = [p for p in means if p["objective"] == obj and p.get("D") == D and p["window"] == D]
    for key in dict.fromkeys((p["lever"], p["rule"]) for p in sel):
        pts = sorted((p for p in sel if (p["lever"], p["rule"]) == key), key=lambda p: p["tokens_per_s"])
        ax.plot([p["tokens_per_s"] for p in pts], [p["accuracy"] for p in pts], STYLE[key[1]], ms=3, lw=1,
                label=f"{key[0]} ({key[1]})")
    ar = [p for p in means if p["arm"] == "baseline" and methods.get(p["objective"]).causal]
    if ar:
        ax.plot([ar[0]["tokens_per_s"]], [ar[0]["accuracy"]], "k*", ms=12, label="AR fine-tune (baseline)")
    ax.set_xlabel("decoding tokens/s (batch 1)")
    ax.set_ylabel("held-out exact match (seed mean)")
    ax.set_title(f"{F.method_label(lever_model)} per lever, W = D")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=5, ncol=2)
    return _save(fig, path)


def plot_tau(means: list[dict], lever_model: dict, rules, path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(rules), figsize=(5.2 * len(rules), 4.2), dpi=120, squeeze=False, sharey=True)
    obj, D = lever_model["objective"], lever_model.get("D")
    for ax, rule in zip(axes[0], rules):
        sel = [p for p in means if p["objective"] == obj and p.get("D") == D and p["window"] == D and p["rule"] == rule]
        for lever in dict.fromkeys(p["lever"] for p in sel):
            pts = sorted((p for p in sel if p["lever"] == lever), key=lambda p: p["tau"])
            ax.plot([min(p["tau"], 2.0) for p in pts], [p["accuracy"] for p in pts], "o-", ms=3, lw=1, label=lever)
        ax.set_title(f"commit rule: {rule}")
        ax.set_xlabel("tau (2.0 = tau 1e6: one token per step)")
        ax.set_ylabel("held-out exact match (seed mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5)
    return _save(fig, path)


def plot_curves(tuned: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.6), dpi=120)
    first = min((t["spec"]["seed"] for t in tuned), default=None)
    for t in tuned:
        if t["spec"]["seed"] != first:
            continue
        c = F.val_curve(t["dir"])
        ax.plot([s for s, _ in c], [v for _, v in c], "-" if t["arm"] == "baseline" else "--", lw=1,
                label=f"{F.method_label(t['spec'])}, {t['lever']}")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("validation loss (held-out conversations)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=5)
    return _save(fig, path)


__all__ = ["plot_frontier", "plot_levers", "plot_tau", "plot_curves"]
