"""Plot the average (and each task) against an ablated parameter from an `unimae evaluate summary` summary.json.

Rows are the labels ``<parameter>=<value>`` (``p_mar=0.5``: UniMAE's paper Fig. 3a; ``k=5``: GEM's number of
summary tokens).

    python recipes/plot_ablation.py results/ablation-pmar-smollm2-135m/summary.json pmar.png
    python recipes/plot_ablation.py results/ablation-gem-k-smollm2-135m/summary.json k.png --parameter k --log-x
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

AXIS = {"p_mar": "p_mar (share of input tokens masked)", "k": "k (GEM summary tokens)"}
TITLE = {"p_mar": "UniMAE mask-ratio ablation", "k": "GEM summary-token ablation"}


def main(summary_path: str, png: str, parameter: str = "p_mar", log_x: bool = False) -> None:
    with open(summary_path) as handle:
        summary = json.load(handle)  # {label: {"tasks", "average", "missing"}}
    prefix = f"{parameter}="
    rows = sorted((float(label[len(prefix) :]), row) for label, row in summary.items() if label.startswith(prefix))
    if not rows:
        raise SystemExit(f"{summary_path} has no row labelled {prefix}<value>")
    values = [v for v, _ in rows]
    tasks = sorted({t for _, row in rows for t in row["tasks"]})
    fig, ax = plt.subplots(figsize=(8, 4))
    for task in tasks:  # each task thin, the average bold
        ax.plot(values, [row["tasks"].get(task, float("nan")) for _, row in rows], lw=0.8, alpha=0.6, label=task)
    # An average over fewer tasks is not comparable with the others: a point with a missing task is left out.
    averages = [row["average"] if not row["missing"] else float("nan") for _, row in rows]
    ax.plot(values, averages, marker="o", lw=2.2, color="black", label="average (points with every task)")
    incomplete = [f"{v:g}" for v, row in rows if row["missing"]]
    if incomplete:
        print(f"{parameter} {', '.join(incomplete)}: some tasks missing, left out of the average")
    if log_x:
        ax.set_xscale("log")
        ax.set_xticks(values, [f"{v:g}" for v in values])
    ax.set_xlabel(AXIS.get(parameter, parameter))
    ax.set_ylabel(f"main score x100 ({len(tasks)} tasks)")
    ax.set_title(TITLE.get(parameter, f"{parameter} ablation"))
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the lines, never on them
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", help="summary.json written by `unimae evaluate summary`")
    parser.add_argument("png", help="output image")
    parser.add_argument("--parameter", default="p_mar", help="label prefix of the rows: p_mar (default) or k")
    parser.add_argument("--log-x", action="store_true", help="logarithmic x axis (k = 1, 2, 5, 10)")
    args = parser.parse_args()
    main(args.summary, args.png, args.parameter, args.log_x)
