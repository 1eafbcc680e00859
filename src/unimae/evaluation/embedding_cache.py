"""On-disk embedding cache: a second evaluation of the same texts costs nothing.

Keyed by (model, adapter, pooling, max_length, precision, :data:`VECTOR_CODE_VERSION`) -> a namespace,
and by the SHA-256 of each text inside it. Stored in one SQLite file (atomic commits, safe to interrupt);
vectors are float32 blobs. ``hits``/``misses`` count lookups for the benchmark's hit rate.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

# The version of the code that turns a cached text (as keyed: prompt included, outer whitespace stripped) into the
# vector stored for it: tokenization and truncation, the model's forward as unimae runs it, pooling. Bump it in any
# change that alters those vectors for the same model, adapter, options and text: every namespace changes with it,
# so no vector of the old code is read again (its rows stay in the file, unused, until the file is deleted). No bump
# for what the namespace already tells apart (a new pooling, an option passed to namespace_key) or for what comes
# after the cache (Matryoshka prefixes, rotation, scoring).
VECTOR_CODE_VERSION = 1


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def namespace_key(**identity) -> str:
    """Stable id of everything that changes an embedding (model, adapter weights, pooling, ...), and of the code
    that computes it (:data:`VECTOR_CODE_VERSION`)."""
    identity = {**identity, "vector_code": VECTOR_CODE_VERSION}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


class EmbeddingCacheError(ValueError):
    """The cache file exists but is not a readable SQLite database."""


class EmbeddingCache:
    """``get_or_compute(texts, compute)`` returns (N, D) float32, computing only the missing texts."""

    def __init__(self, path: str | Path, namespace: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.hits = 0
        self.misses = 0
        self._db = sqlite3.connect(self.path, timeout=120)  # several evaluations may share one file
        try:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS emb (ns TEXT, key TEXT, dim INTEGER, vec BLOB, PRIMARY KEY (ns, key))"
            )
            self._db.commit()
        except sqlite3.DatabaseError as err:
            self._db.close()
            raise EmbeddingCacheError(
                f"the embedding cache {self.path} cannot be read ({err}); delete it (embeddings are recomputed) "
                "or evaluate with --no-cache"
            ) from err

    def close(self) -> None:
        self._db.close()

    def _lookup(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        found: dict[str, np.ndarray] = {}
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), 500):
            chunk = unique[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                f"SELECT key, dim, vec FROM emb WHERE ns = ? AND key IN ({marks})", (self.namespace, *chunk)
            )
            # a blob of the wrong size (a damaged row) counts as missing: it is computed and written again
            found.update({key: np.frombuffer(vec, dtype=np.float32) for key, dim, vec in rows if len(vec) == 4 * dim})
        return found

    def get_or_compute(self, texts: Sequence[str], compute: Callable[[list[str]], np.ndarray]) -> np.ndarray:
        keys = [text_key(t) for t in texts]
        found = self._lookup(keys)
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        n_missing = sum(k not in found for k in keys)
        self.hits += len(keys) - n_missing
        self.misses += n_missing
        if missing:
            first_text = {k: t for k, t in zip(keys, texts, strict=True)}
            vectors = np.asarray(compute([first_text[k] for k in missing]), dtype=np.float32)  # (M, D)
            with self._db:
                self._db.executemany(
                    "INSERT OR REPLACE INTO emb VALUES (?, ?, ?, ?)",
                    [(self.namespace, k, v.shape[0], v.tobytes()) for k, v in zip(missing, vectors, strict=True)],
                )
            found.update(zip(missing, vectors, strict=True))
        return np.stack([found[k] for k in keys]) if keys else np.zeros((0, 0), dtype=np.float32)
