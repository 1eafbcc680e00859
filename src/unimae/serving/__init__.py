"""The OpenAI-compatible server (``unimae serve``): app, routes, shared state, generation slots, SSE, request
guard, request schemas, dynamic batching, settings."""
