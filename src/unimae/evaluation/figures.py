"""Figures: the paper's Figure 2 (t-SNE of a clustering set, base vs trained) and category bars."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from unimae.evaluation.summary import CATEGORIES, task_type

CLUSTERING_TASK = "TwentyNewsgroupsClustering"  # the paper's t-SNE figure


def clustering_sample(
    data_dir: Path, task: str = CLUSTERING_TASK, classes: int = 6, per_class: int = 150, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Texts and labels of the ``classes`` largest classes of the task's first set (sampled)."""
    with open(Path(data_dir) / "clustering" / task / "test.jsonl", encoding="utf-8") as handle:
        first = json.loads(handle.readline())
    largest = [label for label, _ in Counter(first["labels"]).most_common(classes)]
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for label in largest:
        idx = [i for i, y in enumerate(first["labels"]) if y == label]
        for i in rng.choice(idx, size=min(per_class, len(idx)), replace=False):
            texts.append(first["sentences"][i])
            labels.append(label)
    return texts, labels


def tsne_figure(panels: dict[str, np.ndarray], labels: list[str], path: Path, title: str) -> Path:
    """Side-by-side t-SNE (PCA init, as in the paper) of each {name: (N, D) embeddings}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.manifold import TSNE

    names = sorted(set(labels))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.5), squeeze=False)
    for ax, (name, vectors) in zip(axes[0], panels.items(), strict=True):
        tsne = TSNE(n_components=2, init="pca", random_state=0, perplexity=min(30.0, max(2.0, len(labels) / 4)))
        points = tsne.fit_transform(vectors)  # (N, 2)
        for k, label in enumerate(names):
            mask = np.array([y == label for y in labels])
            ax.scatter(points[mask, 0], points[mask, 1], s=6, label=label, color=plt.cm.tab10(k))
        ax.set_title(name)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, markerscale=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def category_bars(summary_json: Path, path: Path) -> Path:
    """Grouped bars of per-category average scores, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(Path(summary_json).read_text())
    methods = list(summary)
    tasks = sorted({t for row in summary.values() for t in row["tasks"]})
    types = {t: task_type(t) for t in tasks}
    cats = [(c, short) for c, short in CATEGORIES if c in types.values()] + [("Avg.", "Avg.")]
    fig, ax = plt.subplots(figsize=(1.6 * len(cats) + 3, 4.5))
    width = 0.8 / max(1, len(methods))
    for m, method in enumerate(methods):
        scores = summary[method]["tasks"]
        values = []
        for cat, _ in cats:
            chosen = list(scores.values()) if cat == "Avg." else [s for t, s in scores.items() if types[t] == cat]
            values.append(sum(chosen) / len(chosen) if chosen else 0.0)
        ax.bar(np.arange(len(cats)) + m * width, values, width, label=method)
    ax.set_xticks(np.arange(len(cats)) + width * (len(methods) - 1) / 2, [short for _, short in cats])
    ax.set_ylabel("score x 100")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
