"""The reward registry: name -> reward function, and ``module:function`` resolution.

A reward function has the signature
``fn(prompt: str, completion: str, reference: str | None, metadata: dict, **kwargs) -> float``,
or ``-> StepScores`` for per-step rewards (``algorithm.advantage=process``; see
``grpo_mega.rewards.steps``).
Built-ins (``grpo_mega.rewards.math``) register themselves by name with the
:func:`register_reward` decorator; a custom function is named
``"package.module:function"`` and imported on use, which is also how a spawned
scoring worker finds it. Config validation (``grpo_mega.preflight.validate``)
checks ``reward.functions`` against ``REWARD_REGISTRY`` and each function's
``reward.kwargs`` against its signature (:func:`check_reward_kwargs`).

A function may carry a ``warm_up(**kwargs)`` attribute: each scoring worker calls
it once, with the function's kwargs, before it takes samples, so heavy imports
(sympy for ``math``) are not charged to the first sample's timeout.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from grpo_mega.common.qualified import import_qualified

__all__ = ["RewardFn", "REWARD_REGISTRY", "register_reward", "resolve_reward", "check_reward_kwargs",
           "RewardSpec"]

RewardFn = Callable[..., float]
REWARD_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available to configs under ``name``."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARD_REGISTRY and REWARD_REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        REWARD_REGISTRY[name] = fn
        return fn

    return deco


def resolve_reward(name: str) -> RewardFn:
    """A registered name, or ``"module:function"`` imported on demand."""
    if name in REWARD_REGISTRY:
        return REWARD_REGISTRY[name]
    if ":" not in name:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARD_REGISTRY)}; "
                       "a custom function is named 'package.module:function'")
    return import_qualified(name, f"reward {name!r}")


def check_reward_kwargs(fn: RewardFn, kwargs: Mapping[str, Any]) -> str | None:
    """Why ``fn(prompt, completion, reference, metadata, **kwargs)`` cannot be called
    (an unknown or a missing keyword, a wrong arity), or None when it can. Binds the
    signature without calling, so a mistake shows at start-up, not in every sample."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to check
    try:
        sig.bind("", "", None, {}, **kwargs)
    except TypeError as e:
        return f"{e}; it takes {sig}"
    return None


@dataclass(frozen=True)
class RewardSpec:
    """One term of the total reward: ``weight * fn(..., **kwargs)``."""

    name: str
    """Registered name or ``"module:function"``."""
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def coerce(cls, spec: "RewardSpec | str | Mapping[str, Any]") -> "RewardSpec":
        if isinstance(spec, RewardSpec):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        unknown = set(spec) - {"name", "weight", "kwargs"}
        if unknown:
            raise ValueError(f"reward spec {dict(spec)} has unknown keys {sorted(unknown)}")
        return cls(spec["name"], float(spec.get("weight", 1.0)), dict(spec.get("kwargs", {})))

