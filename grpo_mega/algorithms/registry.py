"""Name -> implementation registries for the algorithm variants.

Why: the registry is the single source of truth for which names exist. The math
looks variants up here, and config validation (``grpo_mega.preflight.validate``)
lists ``registry.names()``, so a name that no code implements fails at load time
and a newly registered variant is valid in config with no other edit.

    KL_ESTIMATORS = Registry("kl estimator")

    @KL_ESTIMATORS.register("k2", "mse")   # canonical name, then aliases
    def _k2(x): ...

    KL_ESTIMATORS.get("mse", "kl_kind")    # -> _k2; unknown: ValueError naming kl_kind

A registry is a read-only ``Mapping`` over its canonical names (aliases are not
keys), so ``sorted(registry)`` and ``name in registry`` work as on the plain dicts
this replaced; ``.aliases`` maps alias -> canonical name.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple, TypeVar

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Mapping[str, T]):
    """Variants of one kind, registered by decorator under a name and optional aliases."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: Dict[str, T] = {}
        self._aliases: Dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` (and ``aliases``).

        A name or alias already taken raises ValueError: two variants silently
        sharing a name would make a config mean whichever module imported last."""
        for n in (name, *aliases):
            if not isinstance(n, str) or not n:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {n!r}")
            if n in self._items or n in self._aliases:
                raise ValueError(f"{self.kind} {n!r} is already registered")
        if len(set((name, *aliases))) != 1 + len(aliases):
            raise ValueError(f"{self.kind} {name!r}: repeated names in {(name, *aliases)}")

        def deco(obj: T) -> T:
            self._items[name] = obj
            for a in aliases:
                self._aliases[a] = name
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` and its aliases (for tests that register a temporary variant)."""
        if name not in self._items:
            raise KeyError(f"{self.kind} {name!r} is not registered")
        del self._items[name]
        for a in [a for a, n in self._aliases.items() if n == name]:
            del self._aliases[a]

    def get(self, name: str, arg: Optional[str] = None) -> T:  # type: ignore[override]
        """The variant registered as ``name`` or an alias of it.

        Unknown names raise ValueError naming the argument (``arg``, default the
        registry's kind) and every known name, before any collective can hang."""
        if isinstance(name, str):
            if name in self._items:
                return self._items[name]
            if name in self._aliases:
                return self._items[self._aliases[name]]
        raise ValueError(f"{arg or self.kind}={name!r} is unknown; choose one of {list(self.names())}")

    def names(self) -> Tuple[str, ...]:
        """Every accepted name, canonical names and aliases, sorted."""
        return tuple(sorted((*self._items, *self._aliases)))

    @property
    def aliases(self) -> Mapping[str, str]:
        """alias -> canonical name (a live read-only view)."""
        return MappingProxyType(self._aliases)

    # Mapping over canonical names
    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"
