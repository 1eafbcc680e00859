"""The HTTP routes, one ``APIRouter`` per group: ``meta`` (models, health), ``embeddings``, ``completions``
(completions and chat) and ``rag``. Each route takes the shared :class:`~unimae.serving.state.ServerState`
as a ``StateDep`` parameter and returns a plain dict (``response_model=None``: sent as built, never
re-validated) or an SSE stream."""
