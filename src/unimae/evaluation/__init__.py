"""Evaluation on the field's official harnesses: mteb (embeddings) and lm-eval (generation)."""
