"""Plot the average (and each task) against p_mar from an `unimae evaluate summary` summary.json (paper Fig. 3a)."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(summary_path: str, png: str) -> None:
    with open(summary_path) as handle:
        summary = json.load(handle)  # {label: {"tasks", "average", "missing"}}
    rows = sorted((float(label.split("=")[1]), row) for label, row in summary.items() if label.startswith("p_mar="))
    p_mars = [p for p, _ in rows]
    tasks = sorted({t for _, row in rows for t in row["tasks"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    for task in tasks:  # each task thin, the average bold
        ax.plot(p_mars, [row["tasks"].get(task, float("nan")) for _, row in rows], lw=0.8, alpha=0.6, label=task)
    # An average over fewer tasks is not comparable with the others: a point with a missing task is left out.
    averages = [row["average"] if not row["missing"] else float("nan") for _, row in rows]
    ax.plot(p_mars, averages, marker="o", lw=2.2, color="black", label="average (points with every task)")
    incomplete = [f"{p:g}" for p, row in rows if row["missing"]]
    if incomplete:
        print(f"p_mar {', '.join(incomplete)}: some tasks missing, left out of the average")
    ax.set_xlabel("p_mar (share of input tokens masked)")
    ax.set_ylabel(f"main score x100 ({len(tasks)} tasks)")
    ax.set_title("UniMAE mask-ratio ablation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
