"""The gateway section of the run configuration (``gateway.*``): training an agent program.

With ``gateway.enabled`` the rollout stage plays episodes of an agent program that calls
the OpenAI-compatible gateway (``grpo_mega.gateway``, guide: docs/guides/gateway.md)
instead of sampling single responses or stepping an environment. Split out of
``grpo_mega.config`` (which re-exports it); the same rules hold: typed fields, a docstring
under each, no import of the rest of grpo_mega.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["GatewaySection", "GATEWAY_SAMPLING_POLICIES", "GATEWAY_REWRITE_POLICIES"]

GATEWAY_SAMPLING_POLICIES = ("refuse", "override")
GATEWAY_REWRITE_POLICIES = ("reject", "restart")


@dataclass
class GatewaySection:
    enabled: bool = False
    """Train an agent program: each step opens ``rollout.n`` episodes per prompt in the
    gateway, the agent plays them through ``/v1/chat/completions`` with its own loop and
    reports each episode's reward, and the trainer collects them as the step's groups. The
    engines are driven only while a step's episodes run (calls that come between rollouts
    wait while the weights change). Not with ``env.name`` (the agent is the environment)."""
    agent_command: list[str] = field(default_factory=list)
    """The agent program, started by rank 0 at start-up and stopped at the end (e.g.
    ``[python, -m, grpo_mega.demo.gateway_agent]``; a first word ``python`` is the
    trainer's own interpreter, so the agent runs in its environment). Its environment carries
    ``GRPO_GATEWAY_URL`` and ``GRPO_GATEWAY_API_KEY``; it asks ``POST /tasks/next`` for
    episodes. Empty: start the agent yourself; the URL and key are in
    ``<run_dir>/gateway.json`` (mode 0600)."""
    host: str = "127.0.0.1"
    """Address the gateway listens on. Loopback by default: it runs the model for anyone who
    can reach it and writes what they send into training data."""
    port: int = 0
    """TCP port; 0 picks a free one (written to ``<run_dir>/gateway.json``)."""
    api_key: Optional[str] = None
    """The key every request must carry (``Authorization: Bearer``, checked before a body
    is read). None: a random key per run, handed to ``agent_command`` and written to
    ``<run_dir>/gateway.json``."""
    chat_format: str = "auto"
    """The chat template family that renders and parses turns (``auto``: detected from the
    tokenizer's chat template; ``package.module:ATTR`` names a ``ChatFormat``)."""
    sampling_policy: str = "refuse"
    """A request asking for another temperature, top-p, top-k, or any seed: ``refuse``
    (400 naming the field and the configured value) or ``override`` (served at the
    trainer's sampling, counted). The trainer's sampling is ``rollout.*``; seeds are per
    episode."""
    on_rewrite: str = "reject"
    """A call that rewrites its episode's history: ``reject`` (409) or ``restart`` (the
    episode's trajectory starts again from the new messages)."""
    max_tokens: int = 512
    """An episode's token budget after its first prompt (the model's replies and the
    agent's additions); each call's ``max_tokens`` is clipped to what is left and to
    ``rollout.max_new_tokens`` per reply."""
    episode_timeout_seconds: float = 600.0
    """How long a rollout waits for its episodes to be finished (``POST
    /episodes/<id>/finish``); past it each unfinished episode is ended by the trainer
    (its later calls get 409), scored ``gateway.error_reward`` and counted in
    ``episode_env_errors``; the run goes on. The run stops only when the agent program it
    started has exited."""
    error_reward: Optional[float] = 0.0
    """The reward of an episode the trainer ended at ``gateway.episode_timeout_seconds``
    (its tokens so far are trained with it, as an environment error's). None: the
    episode's whole group is dropped from training (counted in ``episodes_dropped``)."""
    max_connections: int = 256
    """Most connections the gateway serves at once (one thread each); set it above the
    number of agents running side by side."""
