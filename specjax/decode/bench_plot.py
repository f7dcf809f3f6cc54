"""The bench report's figure (``specjax bench --plot``): per-position acceptance, tokens per
target forward, and the tree candidates of ``--tree auto``."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot(report, path: str | Path) -> Path:
    """PNG: per-position acceptance (bars: P(accepted), line: conditional) and the histogram of
    tokens committed per target forward; with ``--tree auto`` a third panel of the tree candidates.
    ``report``: a :class:`specjax.decode.bench.BenchReport` or its ``data`` dict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = report if isinstance(report, dict) else report.data
    k = d["k"]
    auto = d.get("tree", {}).get("auto")
    fig, axes = plt.subplots(1, 3 if auto else 2, figsize=(15 if auto else 10, 4))
    a1, a2 = axes[0], axes[1]
    pos = np.arange(1, k + 1)
    a1.bar(pos, d["per_position_acceptance"], color="#4c72b0", label="P(accepted)")
    cond = [np.nan if x is None else x for x in d["conditional_acceptance"]]
    a1.plot(pos, cond, "o-", color="#dd8452", label="P(accepted | previous accepted)")
    a1.set_xlabel("draft position")
    a1.set_ylabel("acceptance rate")
    a1.set_ylim(0, 1.25)
    a1.set_xticks(pos)
    a1.legend(loc="upper center", fontsize=8, ncol=2)
    a1.set_title(f"{d['algorithm']} draft, k={k}, tau={d['tau']:.2f}")
    tps = {int(j): n for j, n in d["tokens_per_step"].items()}
    xs = np.arange(1, k + 2)
    a2.bar(xs, [tps.get(int(x), 0) for x in xs], color="#55a868")
    a2.set_xlabel("tokens committed per target forward")
    a2.set_ylabel("rounds")
    a2.set_xticks(xs)
    a2.set_title(f"speedup {d['speedup']:.2f}x (predicted {d['predicted_speedup']:.2f}x)")
    if auto:
        _plot_tree_auto(axes[2], d)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _plot_tree_auto(ax, d: dict) -> None:
    """``--tree auto``'s candidates: predicted speedup (and tau) per node count, the pick and the
    measured speedups of the tree and the chain."""
    t = d["tree"]
    cands = t["auto"]["candidates"]
    n = [c["nodes"] for c in cands]
    ax.plot(n, [c["predicted_speedup"] for c in cands], "o-", color="#4c72b0", label="predicted speedup")
    ax.plot([t["nodes"]], [t["speedup"]], "*", ms=14, color="#c44e52", label=f"tree measured {t['speedup']:.2f}x")
    ax.axhline(d["speedup"], color="#55a868", ls="--", label=f"chain k={d['k']} measured {d['speedup']:.2f}x")
    ax.set_xlabel("tree nodes (best tree of each size)")
    ax.set_ylabel("speedup over target-only")
    tw = ax.twinx()
    tw.plot(n, [c["predicted_tau"] for c in cands], "s:", color="#8172b2", label="predicted tau")
    tw.set_ylabel("predicted tau")
    lines = ax.get_legend_handles_labels()
    more = tw.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    ax.set_title(f"tree auto: picked {t['nodes']} nodes, depth {t['depth']}, tau {t['tau']:.2f}")
