"""The method registry: ``--method NAME`` -> a :class:`~unimae.methods.base.Method` subclass."""

from __future__ import annotations

METHOD_REGISTRY: dict[str, type] = {}


def register_method(cls: type) -> type:
    """Class decorator: make ``cls`` available as ``--method cls.name``."""
    METHOD_REGISTRY[cls.name] = cls
    return cls


def get_method(name: str) -> type:
    if name not in METHOD_REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHOD_REGISTRY)}")
    return METHOD_REGISTRY[name]
