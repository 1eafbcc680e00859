"""Retrieval with the model's own embeddings: vector indexes (in memory, on disk, built on Ray) and RAG."""
