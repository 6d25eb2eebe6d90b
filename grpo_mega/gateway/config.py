"""The gateway's settings (one typed dataclass, a docstring per field).

The limits (``read_timeout_s`` to ``max_open_episodes``) bound what clients can make the
trainer's process hold: threads, time, memory, episodes. ``docs/concepts/security.md``
lists each with its default; ``gateway.limits`` says how they are enforced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["GatewayConfig", "REWRITE_POLICIES", "SAMPLING_POLICIES"]

REWRITE_POLICIES = ("reject", "restart")
SAMPLING_POLICIES = ("refuse", "override")
_SECONDS = ("read_timeout_s", "idle_timeout_s")
_POSITIVE = ("max_body_bytes", *_SECONDS, "max_connections", "max_header_bytes", "max_total_body_bytes",
             "max_json_depth", "max_open_episodes")


@dataclass(frozen=True)
class GatewayConfig:
    """How the OpenAI-compatible gateway serves and records episodes."""

    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default: the gateway runs the model for anyone who
    can reach it and writes what they send into training data. Any other address is logged
    as a warning at start; set ``api_key`` then."""
    port: int = 0
    """TCP port; 0 picks a free one (read it back from ``GatewayServer.url``)."""
    model_name: str = "grpo-mega"
    """The model id ``GET /v1/models`` lists and responses carry. A request may name any
    model: agents written for another model work unchanged."""
    api_key: Optional[str] = None
    """When set, every request must send ``Authorization: Bearer <api_key>`` (the openai
    client's ``api_key=``); otherwise 401. None: no check (loopback use)."""
    max_model_len: Optional[int] = None
    """The engine's context length. Set: a call's ``max_tokens`` is clipped to what is left
    of it, and a conversation that leaves no room gets a 400 (``context_length_exceeded``)
    before the engine sees it. None: the engine's own check answers (a 400 too)."""
    on_rewrite: str = "reject"
    """A call whose messages do not extend the episode's recorded conversation (the agent
    edited, dropped or summarised earlier turns, or changed ``tools``): ``"reject"`` answers
    409 ``history_rewritten``; ``"restart"`` starts the episode's trajectory again from the
    new messages (the earlier model tokens leave the sample; ``episode_info["restarts"]`` and
    ``["dropped_model_tokens"]`` count them). Token-exactness holds either way: nothing is
    re-tokenized from text and trained on."""
    sampling_policy: str = "refuse"
    """The trainer owns sampling: every call samples at the gateway's ``SamplingConfig``
    (the trainer's ``rollout.temperature``, ``top_p``, ``top_k``; seeds drawn per episode
    from its ``seed``, so the episodes of a GRPO group differ). A request that asks for
    another ``temperature``, ``top_p``, ``top_k`` or any ``seed``: ``"refuse"`` answers 400
    naming the field and the configured value; ``"override"`` serves it at the gateway's
    sampling and counts it in ``episode_info["sampling_overridden"]``. Either way no group
    mixes distributions, and the recorded log-probs are those the loss assumes."""
    max_episode_tokens: Optional[int] = None
    """An episode's token budget: tokens after its first prompt (the model's replies and
    the agent's additions), at most. A call's ``max_tokens`` is clipped to what is left (and
    to the sampling's ``max_new_tokens`` per reply); a call with nothing left is a 400
    (``episode_budget_exhausted``). None: only the context length bounds it."""
    batch_wait_s: float = 0.005
    """How long the engine thread waits for more calls to join a generate batch (agents
    running side by side share one engine call)."""
    max_batch: int = 64
    """Most calls in one generate batch."""
    request_timeout_s: float = 600.0
    """A call whose generation has not come back after this long gets a 504."""
    max_body_bytes: int = 16 * 2**20
    """Largest request body accepted: a larger ``Content-Length`` is answered 413 before a
    byte of the body is read, and the read never takes more than the length announced."""
    read_timeout_s: float = 30.0
    """From a request's first byte, how long the client has to send its request line,
    headers and whole body (one deadline for all of it: a client trickling a byte at a time
    cannot renew it); sending a response is bounded the same way. Past it the connection is
    closed and nothing of the request is processed."""
    idle_timeout_s: float = 30.0
    """How long a connection may wait for its next request (or its first) before it is
    closed. The openai client drops its own idle connections after 5 s."""
    max_connections: int = 256
    """Most connections served at once; each holds one thread. One more is answered 503
    (``Retry-After: 1``, ``too_many_connections``) and closed by the accepting thread
    without a thread of its own. Set it above the number of agents running side by side."""
    max_header_bytes: int = 64 * 2**10
    """Largest request line plus headers (431 above it)."""
    max_total_body_bytes: int = 256 * 2**20
    """Most request-body bytes held at once over all connections (from the read until the
    answer is sent). A request whose body does not fit is answered 503 before it is read.
    At least ``max_body_bytes``."""
    max_json_depth: int = 64
    """Deepest nesting of arrays and objects accepted in a JSON body (400 deeper): deeply
    nested JSON would otherwise exhaust the recursion of the parser, the template renderer
    or the encoder."""
    max_open_episodes: int = 4096
    """Most episodes held at once (open or finished, until ``collect`` or ``discard``
    removes them). Opening one more, by ``POST /episodes`` or a chat call to a new id, is
    answered 429 (``too_many_episodes``)."""
    auto_open: bool = True
    """True: a chat call to an unknown episode id opens that episode (so an agent only needs
    a base URL). False: episodes must be opened first (``POST /episodes`` or
    ``Gateway.open_episode``); calls to unknown ids get 404."""

    def __post_init__(self) -> None:
        if self.sampling_policy not in SAMPLING_POLICIES:
            raise ValueError(f"gateway sampling_policy={self.sampling_policy!r}; choose one of {SAMPLING_POLICIES}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ValueError(f"gateway max_episode_tokens={self.max_episode_tokens} must be >= 1 (or None)")
        if self.on_rewrite not in REWRITE_POLICIES:
            raise ValueError(f"gateway on_rewrite={self.on_rewrite!r}; choose one of {REWRITE_POLICIES}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"gateway port={self.port} is not a TCP port (0 picks a free one)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"gateway max_model_len={self.max_model_len} must be >= 2 (or None)")
        if self.max_batch < 1 or self.batch_wait_s < 0 or self.request_timeout_s <= 0:
            raise ValueError("gateway max_batch must be >= 1, batch_wait_s >= 0 and request_timeout_s > 0")
        for name in _POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or value == float("inf") or (name not in _SECONDS and not isinstance(value, int)):
                kind = "a finite number of seconds > 0" if name in _SECONDS else "an integer >= 1"
                raise ValueError(f"gateway {name}={value!r} must be {kind} (GatewayConfig.{name})")
        if self.max_total_body_bytes < self.max_body_bytes:
            raise ValueError(f"gateway max_total_body_bytes={self.max_total_body_bytes} is below max_body_bytes="
                             f"{self.max_body_bytes}: no body of the largest size could ever be read "
                             "(raise GatewayConfig.max_total_body_bytes)")
