"""Evaluation on the field's official harnesses, mteb (embeddings) and lm-eval (generation), the quick
before/after check of an adapter, and the tables and figures made from their results."""
