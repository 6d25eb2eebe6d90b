"""Environments for multi-turn, tool-using episodes, and the tools they offer.

This part owns what the model talks to during an episode, and nothing of how tokens
are produced or trained on: the protocol (``types``: messages, :class:`Tool`,
:class:`StepResult`, :class:`Environment` with ``reset(row)``, ``step(message)``,
``close()``), the registry (``registry``: :func:`register_env`, :func:`resolve_env` for
a registered name or ``"package.module:Class"``, :func:`make_env` from config kwargs),
the sandbox that runs model-written code (``sandbox``: a separate process without
network or host sockets, writing only to a private tmpfs scratch, unable to change any
host file or outlive its call, under CPU, memory, output and wall-clock limits), and the built-in environments: ``calculator`` (safe arithmetic) and
``python_tool`` (sandboxed Python), both on the :class:`ToolEnv` base (``tool_env``:
tool dispatch, turn limit, a final answer scored by ``grpo_mega.rewards``). Rendering
messages to tokens is ``grpo_mega.data.chat``'s job, running episodes the rollout's.
Imports nothing of the training stack (an import-linter contract); only the rewards.
"""
from grpo_mega.envs.calculator import CalculatorEnv, CalculatorError, evaluate
from grpo_mega.envs.python_tool import PythonToolEnv
from grpo_mega.envs.registry import ENV_REGISTRY, EnvFactory, check_env_kwargs, make_env, register_env, resolve_env
from grpo_mega.envs.sandbox import Sandbox, SandboxConfig, SandboxResult, SandboxUnavailable, run_python
from grpo_mega.envs.tool_env import ToolEnv, call_tool, check_arguments
from grpo_mega.envs.types import Environment, Message, StepResult, Tool, ToolCall

__all__ = [
    "Message", "ToolCall", "StepResult", "Tool", "Environment",
    "EnvFactory", "ENV_REGISTRY", "register_env", "resolve_env", "check_env_kwargs", "make_env",
    "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailable", "run_python",
    "ToolEnv", "call_tool", "check_arguments",
    "CalculatorEnv", "CalculatorError", "evaluate", "PythonToolEnv",
]
