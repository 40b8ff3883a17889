"""Imports deferred to first use, so that the command line parses and validates a run's
options without loading torch (about 2 s of a 2-core machine's start-up; ``grpo-fast --help``
answers in a fraction of that).

    torch = LazyModule("torch", globals())      # a module's global: the real torch on first use
    __getattr__ = lazy_exports(__name__, {"GRPOTrainer": "grpo_fast.trainer.grpo"})   # a package
"""

import importlib


class LazyModule:
    """Stands in for the module ``name`` in the namespace ``where`` (a module's ``globals()``)
    until an attribute is read: then it imports the module and puts it in its own place, so
    later reads of the global cost nothing."""

    def __init__(self, name: str, where: dict):
        self._name, self._where = name, where

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._name)
        for key, value in list(self._where.items()):
            if value is self:
                self._where[key] = module
        return getattr(module, attr)


def lazy_exports(package: str, exports: dict):
    """A package's module-level ``__getattr__`` (PEP 562) that imports ``exports[name]``, the
    module defining ``name``, when ``package.name`` is first read."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
