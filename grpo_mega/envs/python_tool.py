"""The ``python_tool`` environment: one tool that runs Python in the sandbox.

The model calls ``python(code)``; the code runs in a fresh confined process
(:mod:`grpo_mega.envs.sandbox`: no network, writes only to a temporary directory, CPU,
memory, output and wall-clock limits) and the model reads its stdout and stderr, cut to
the sandbox's output budget, with a bracketed note when the code was stopped. A final
expression's value is printed, as in an interactive interpreter. Each call starts from
nothing: no variables or files survive between calls.

The sandbox is built once when the environment is made (:meth:`Sandbox.check`), so a
machine that cannot confine the code fails at start-up, naming the flag that opts out,
and never mid-run. The episode's reward is the ``math`` reward of the final message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_mega.envs.registry import register_env
from grpo_mega.envs.sandbox import Sandbox
from grpo_mega.envs.tool_env import ToolEnv
from grpo_mega.envs.types import Tool

__all__ = ["PythonToolEnv"]


@register_env("python_tool")
@dataclass(eq=False)
class PythonToolEnv(ToolEnv):
    """Answer a question with a ``python(code)`` tool run in the sandbox; scored by the
    math reward."""

    sandbox: Any = None
    """The sandbox's limits: a mapping of :class:`~grpo_mega.envs.sandbox.SandboxConfig`
    fields (``{cpu_seconds: 2, memory_mb: 256, ...}``); None takes the defaults."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._sandbox = Sandbox(self.sandbox)
        self._sandbox.check()
        self.tools = [Tool(
            name="python",
            description=("Run a Python program (standard library only) and read what it prints; "
                         "the value of a final expression is printed too. Nothing persists between calls."),
            parameters={"type": "object", "required": ["code"],
                        "properties": {"code": {"type": "string", "description": "the program"}}},
            fn=self.run_python)]

    def run_python(self, code: str) -> str:
        """The tool: the program's output as the model reads it."""
        return self._sandbox.run(code).text()
