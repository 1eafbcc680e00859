"""Plot the dev-suite average against p_mar from an `unimae evaluate summary` summary.json (paper Fig. 3a)."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(summary_path: str, png: str) -> None:
    with open(summary_path) as handle:
        summary = json.load(handle)  # {label: {"tasks", "average", "missing"}}
    points = sorted(
        (float(label.split("=")[1]), row["average"]) for label, row in summary.items() if label.startswith("p_mar=")
    )
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([p for p, _ in points], [a for _, a in points], marker="o")
    ax.set_xlabel("p_mar (share of input tokens masked)")
    ax.set_ylabel("dev-suite average (x100)")
    ax.set_title("UniMAE mask-ratio ablation")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
