"""A registry of names -> ``"module:attr"`` targets, each imported on first use.

It lets a lower package offer a choice whose implementations live above it, or in a user's own
package, without importing them: the embedding compute backends (``pipeline.modules.backends``)
and the serving cache tiers (``export.cache``).

Example::

    tiers = Registry("cache policy", {"lru": "export.cache:LruCache"})
    tiers.register("mine", "my_package.cache:MyTier")
    tiers.load("lru")          # the class, imported now
"""

from __future__ import annotations

import importlib
from typing import Any


class Registry(dict):
    """A ``dict`` of name -> ``"module:attr"``, with checked registration and loading by name."""

    def __init__(self, what: str, entries: dict[str, str]) -> None:
        super().__init__()
        self.what = what
        for name, target in entries.items():
            self.register(name, target)

    def register(self, name: str, target: str) -> None:
        """Make ``target`` (``"module:attr"``) available as ``name``; it is imported on first use."""
        if ":" not in target:
            raise ValueError(f"{self.what} {name!r}: expected a 'module:attr' target, got {target!r}")
        self[name] = target

    def names(self) -> list[str]:
        return sorted(self)

    def load(self, name: str) -> Any:
        """The object registered as ``name``, imported now."""
        if name not in self:
            raise ValueError(f"{self.what} {name!r} is not registered; available: {self.names()}")
        module, attr = self[name].split(":")
        return getattr(importlib.import_module(module), attr)
