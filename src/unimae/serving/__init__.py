"""The OpenAI-compatible server (``unimae serve``): app, request schemas, dynamic batching, settings."""
