"""A training run: its configuration, the loop that trains a method's objective, and resumable checkpoints."""
