"""The gateway's settings (one typed dataclass, a docstring per field)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["GatewayConfig", "REWRITE_POLICIES"]

REWRITE_POLICIES = ("reject", "restart")


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
    use_request_sampling: bool = True
    """True: a request's ``temperature``, ``top_p``, ``top_k`` and ``seed`` are used (absent
    ones come from the gateway's sampling). False: the gateway's sampling always wins (a
    trainer whose loss assumes one temperature); requests that asked for something else are
    counted in ``episode_info["sampling_overridden"]``."""
    batch_wait_s: float = 0.005
    """How long the engine thread waits for more calls to join a generate batch (agents
    running side by side share one engine call)."""
    max_batch: int = 64
    """Most calls in one generate batch."""
    request_timeout_s: float = 600.0
    """A call whose generation has not come back after this long gets a 504."""
    max_body_bytes: int = 16 * 2**20
    """Largest request body accepted (413 above it)."""
    auto_open: bool = True
    """True: a chat call to an unknown episode id opens that episode (so an agent only needs
    a base URL). False: episodes must be opened first (``POST /episodes`` or
    ``Gateway.open_episode``); calls to unknown ids get 404."""

    def __post_init__(self) -> None:
        if self.on_rewrite not in REWRITE_POLICIES:
            raise ValueError(f"gateway on_rewrite={self.on_rewrite!r}; choose one of {REWRITE_POLICIES}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"gateway port={self.port} is not a TCP port (0 picks a free one)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"gateway max_model_len={self.max_model_len} must be >= 2 (or None)")
        if self.max_batch < 1 or self.batch_wait_s < 0 or self.request_timeout_s <= 0:
            raise ValueError("gateway max_batch must be >= 1, batch_wait_s >= 0 and request_timeout_s > 0")
