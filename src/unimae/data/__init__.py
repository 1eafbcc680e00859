"""What training reads and how it is batched: texts and pairs, the order of examples, batches and their masks."""
