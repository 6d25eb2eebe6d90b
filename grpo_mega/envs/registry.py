"""The environment registry: name -> environment factory, and ``module:Class`` resolution.

An environment factory is a class (or a function) whose keyword arguments are the
environment's configuration and which returns an :class:`~grpo_mega.envs.types.Environment`.
Built-ins (``grpo_mega.envs.calculator``, ``grpo_mega.envs.python_tool``) register
themselves by name with the :func:`register_env` decorator; a custom one is named
``"package.module:Class"`` and imported on use. :func:`make_env` builds one from config
kwargs, and :func:`check_env_kwargs` says, without building anything, why given kwargs
do not fit (so a config mistake shows at start-up and names the bad key).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from grpo_mega.envs.types import Environment
from grpo_mega.common.qualified import import_qualified

__all__ = ["EnvFactory", "ENV_REGISTRY", "register_env", "resolve_env", "check_env_kwargs", "make_env"]

EnvFactory = Callable[..., Environment]
ENV_REGISTRY: dict[str, EnvFactory] = {}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: make the class (or factory) available to configs under ``name``."""

    def deco(factory: EnvFactory) -> EnvFactory:
        if name in ENV_REGISTRY and ENV_REGISTRY[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered (by {ENV_REGISTRY[name]!r})")
        ENV_REGISTRY[name] = factory
        return factory

    return deco


def resolve_env(name: str) -> EnvFactory:
    """A registered name, or ``"package.module:Class"`` imported on demand."""
    if name in ENV_REGISTRY:
        return ENV_REGISTRY[name]
    if ":" not in name:
        raise KeyError(f"unknown environment {name!r}; registered: {sorted(ENV_REGISTRY)}; "
                       "a custom one is named 'package.module:Class'")
    return import_qualified(name, f"environment {name!r}", "class or callable")


def check_env_kwargs(factory: EnvFactory, kwargs: Mapping[str, Any]) -> str | None:
    """Why ``factory(**kwargs)`` cannot be called (an unknown keyword, a missing one,
    a positional-only parameter), naming it, or None when it can. Binds the signature
    without calling."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None  # no signature to check (a builtin)
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in kwargs if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY)
    if unknown and not takes_any:
        return f"unknown kwarg(s) {unknown}; it takes {sig}"
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        return f"{e}; it takes {sig}"
    return None


def make_env(name: str, kwargs: Mapping[str, Any] | None = None) -> Environment:
    """Build the environment ``name`` (see :func:`resolve_env`) from config ``kwargs``.
    A kwarg the factory does not take, or a missing required one, is a ``TypeError``
    naming it and the environment; so is a result that is not an Environment. The
    factory's own ``TypeError``/``ValueError`` (a bad value) gets the name prefixed."""
    kwargs = dict(kwargs or {})
    factory = resolve_env(name)
    problem = check_env_kwargs(factory, kwargs)
    if problem:
        raise TypeError(f"environment {name!r}: {problem} (fix the environment's kwargs in the config)")
    try:
        env = factory(**kwargs)
    except (TypeError, ValueError) as e:  # a kwarg's value the factory refuses (it names the kwarg)
        raise type(e)(f"environment {name!r}: {e}") from e
    if not isinstance(env, Environment):
        raise TypeError(f"environment {name!r}: {factory!r} returned {type(env).__name__}, which lacks "
                        "the Environment protocol (tools, reset, step, close)")
    return env
