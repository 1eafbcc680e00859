"""The method registry: ``--method NAME`` -> a :class:`~unimae.training.methods.base.Method` subclass."""

from __future__ import annotations

from unimae.training.config import METHOD_OPTIONS

METHOD_REGISTRY: dict[str, type] = {}


def register_method(cls: type) -> type:
    """Class decorator: make ``cls`` available as ``--method cls.name``, its ``options_class`` as that method's
    ``TrainConfig.options`` (and their fields as flags)."""
    METHOD_REGISTRY[cls.name] = cls
    METHOD_OPTIONS[cls.name] = cls.options_class
    return cls


def get_method(name: str) -> type:
    """The Method class of ``--method name``."""
    if name not in METHOD_REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHOD_REGISTRY)}")
    return METHOD_REGISTRY[name]
