"""Multi-turn, tool-using episodes, token-in/token-out.

What: :func:`run_episodes` plays G episodes per prompt against an environment
(``grpo_mega.envs``) and returns one :class:`RolloutBatch` whose samples are whole
episodes. Each turn the engine samples an assistant turn from the episode's token ids
so far; the turn's text is parsed into a message (content, tool calls) by the chat
format; the environment answers; the chat format renders that answer, and the next
generation prompt, as ids that are appended. The trajectory the trainer sees is
exactly the ids the engine consumed and produced: earlier turns are never re-tokenized
from text (a re-tokenized history can differ from what was sampled, and the model is
then trained on tokens it never produced). ``response_mask`` is 1 on the model's
tokens only, and each model token keeps its rollout log-prob (0.0 on the others).

An episode ends when the environment says ``done``, when a turn is cut by its length
limit (finish ``"length"``: a cut turn cannot be parsed), when ``max_turns`` assistant
turns have run (finish ``"turns"``), or when the next turn would not fit the token
budget (finish ``"length"``). The environment's last reply is never appended: nothing
would read it. The episode's reward is the sum of its turns' rewards.

Where things run: episodes advance in lockstep turns, one ``generate`` call per turn
for every active episode of this engine replica. The environments live on the
replica's first rank only (``share``): its results (plain JSON-able messages and
numbers) are broadcast to the replica's other ranks, which then append the very same
ids, so sandboxed tools run once and a tool's timing cannot make ranks disagree.
Meanwhile the other ranks wait in a collective under its timeout, so one turn's
environment steps run in threads, ``EpisodeLimits.env_workers`` at once, within a wall
budget (``env_budget_seconds``) set below that timeout (one after the other, 128 tool
calls of 5 s each had outlasted a 10-minute timeout).

Episodes are isolated from each other's environments: a ``step`` that raises, that runs
past ``step_timeout_seconds``, or that is unfinished when the turn's budget is spent ends
its own episode (finish ``"error"``, the error recorded in ``episode_info["error"]``, the
episode's reward ``error_reward``), never the run. A hung step keeps its thread until it
returns (Python cannot stop a thread); its result is then ignored.

The token-exact invariant is checked for every episode (``codec.check``); problems are
counted in ``episode_info["token_mismatch"]`` (a metric), and an episode that fails it is
not trained: its whole group is dropped (every response token's mask set to 0, so the
loss and its normalisers skip the group; ``episode_info["dropped"]``), because the other
episodes' advantages are relative to it. So is the group of an episode that ended with an
environment error when ``error_reward`` is None. Stop strings are refused
(``sampling.stop``): a turn cut at one has no end-of-turn token, so the environment's
reply would follow a turn the template never closes (see ``preflight.validate``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from grpo_mega.envs.types import Environment, Message
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig

__all__ = ["EpisodeLimits", "TurnCodec", "run_episodes", "TURN_SEED_STRIDE"]

log = logging.getLogger(__name__)

TURN_SEED_STRIDE = 1000
"""Turn t of step s draws its seeds with the key ``s * TURN_SEED_STRIDE + t`` (so
``max_turns`` must stay below it): every (step, turn, episode) has its own stream."""


@dataclass(frozen=True)
class EpisodeLimits:
    """When an episode stops, besides the environment's ``done``."""

    max_turns: int = 4
    """Assistant turns per episode."""
    max_tokens: int = 512
    """Tokens after the first prompt (the model's and the environment's together)."""
    max_model_len: int = 1024
    """The engine's context: first prompt + everything after it."""
    env_workers: int = 1
    """Environment steps of one turn run at once, in threads (``env.tool_workers``)."""
    env_budget_seconds: Optional[float] = None
    """Wall-clock budget of one turn's environment steps (``env.turn_budget_seconds``);
    None: unbounded. Steps unfinished at the budget end their episodes with an error."""
    step_timeout_seconds: Optional[float] = None
    """Wall-clock limit of one tool-answering ``env.step`` (``env.step_timeout_seconds``),
    counted from its start; past it the episode ends with an error. None: only the turn's
    budget bounds it. Final answers are scored on the calling thread and bounded by the
    reward's own timeout instead."""
    error_reward: Optional[float] = 0.0
    """The reward of an episode ended by an environment error (``env.error_reward``);
    None drops the episode's group from training."""

    def __post_init__(self) -> None:
        if self.env_workers < 1:
            raise ValueError(f"env.tool_workers={self.env_workers} must be >= 1")
        if self.env_budget_seconds is not None and not self.env_budget_seconds > 0:
            raise ValueError(f"env.turn_budget_seconds={self.env_budget_seconds} must be > 0")
        if self.step_timeout_seconds is not None and not self.step_timeout_seconds > 0:
            raise ValueError(f"env.step_timeout_seconds={self.step_timeout_seconds} must be > 0")
        if not 1 <= self.max_turns < TURN_SEED_STRIDE:
            raise ValueError(f"env max_turns={self.max_turns} must be in [1, {TURN_SEED_STRIDE})")
        if self.max_tokens < 1:
            raise ValueError(f"env max_tokens={self.max_tokens} must be >= 1")


class TurnCodec(Protocol):
    """What the driver needs of a chat format (``rollout.chat_codec.ChatCodec`` binds
    ``grpo_mega.data.chat`` to a tokenizer)."""

    eot_id: int
    """The token that ends an assistant turn; every turn is sampled with it as a stop token."""

    def first_ids(self, messages: list[Message], tools: list[dict]) -> list[int]:
        """The first prompt: the messages rendered with the generation prompt."""
        ...

    def delta_ids(self, history: list[Message], new: list[Message], tools: list[dict]) -> list[int]:
        """Ids to append after the model's last token: separators, ``new``, the next
        generation prompt. ``history`` ends with the assistant message just parsed."""
        ...

    def parse(self, ids: list[int]) -> Message:
        """The assistant message of one sampled turn (content, reasoning, tool calls)."""
        ...

    def check(self, prompt_ids: list[int], segments: list[tuple[str, list[int]]], messages: list[Message],
              tools: list[dict], response_ids: list[int], response_mask: list[int],
              truncated: list[bool]) -> list[str]:
        """The token-exact invariant: problems found (empty: exact). ``segments`` are
        ``("model", ids)`` and ``("env", ids)`` in order; ``response_ids``/``response_mask``
        what the trainer will read; ``truncated``: per model segment, cut by a length limit."""
        ...


@dataclass
class _Episode:
    """One episode's state while it runs (identical on every rank of the replica)."""

    key: int                      # global sample index: prompt_index * G + j
    prompt_index: int
    prompt_ids: list[int]
    messages: list[Message]
    tools: list[dict]
    ids: list[int] = field(default_factory=list)       # everything after the first prompt
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[tuple[str, list[int]]] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    cut: list[bool] = field(default_factory=list)  # per model segment: cut by a length limit
    finish: Optional[str] = None  # None while running
    text: str = ""                # the last assistant message's content
    error: Optional[str] = None   # the environment error that ended the episode
    versions: Optional[list[int]] = None
    """Per token of ``ids``, the policy version that sampled it (asynchronous GRPO: a turn
    engine that stamps its tokens); None when no turn was stamped."""

    def add(self, kind: str, ids: list[int], logprobs: Optional[list[float]] = None,
            versions: Optional[list[int]] = None) -> None:
        self.ids += ids
        self.mask += [1 if kind == "model" else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.segments.append((kind, list(ids)))
        if versions is not None:  # a stamped model turn: its tokens' own versions
            if len(versions) != len(ids):
                raise ValueError(f"episode {self.key}: {len(versions)} versions for a turn of {len(ids)} tokens")
            self.versions = (self.versions or []) + list(versions)
        elif self.versions is not None:  # the environment's reply: never trained (mask 0), so
            # its stamp only keeps the list aligned; the last model token's version
            self.versions += [self.versions[-1] if self.versions else 0] * len(ids)


def turn_sampling(sampling: SamplingConfig, codec: TurnCodec) -> SamplingConfig:
    """One sample per request, stopping at the template's end-of-turn token; stop strings
    refused (a turn cut at one has no end-of-turn token before the environment's reply)."""
    if sampling.stop:
        raise ValueError(f"stop strings {list(sampling.stop)} with an environment: a turn cut at one has no "
                         "end-of-turn token, yet the environment's reply would follow it; episodes end turns "
                         "at the template's end-of-turn token already (--rollout.stop=[])")
    return dataclasses.replace(sampling, n=1, stop_token_ids=tuple(sorted({*sampling.stop_token_ids,
                                                                          codec.eot_id})))


def _local_share(fn: Callable[[], Any]) -> Any:
    return fn()


def run_episodes(generate: Callable[..., RolloutBatch], codec: TurnCodec, make_env: Callable[[], Environment],
                 rows: Sequence[dict], sampling: SamplingConfig, limits: EpisodeLimits, *, step: int,
                 offset: int = 0, share: Callable[[Callable[[], Any]], Any] = _local_share,
                 any_active: Optional[Callable[[bool], bool]] = None,
                 dummy_ids: Optional[list[int]] = None) -> RolloutBatch:
    """``sampling.n`` episodes for each of ``rows`` (prompt ``offset + i`` of the global
    batch), group-major like single-turn batches.

    generate(prompt_id_lists, sampling, step=, keys=, budgets=): the engine's replica-local
        generate (one sample per prompt; ``keys`` the per-request seed indices, ``budgets``
        their max_new_tokens). Called exactly once per turn (lockstep replicas rely on it).
    make_env(): a fresh environment (called on the replica's first rank only).
    share(fn): runs ``fn`` on the replica's first rank and returns its result on every
        rank of the replica (plain data only).
    any_active(flag): collective over the engine replicas that must call ``generate``
        together (vLLM's data-parallel external launcher); None when each replica is free.
        A replica with nothing left then samples ``dummy_ids`` for one token, discarded.
    """
    g, one = sampling.n, turn_sampling(sampling, codec)
    envs: dict[int, Environment] = {}

    def reset_all() -> list[tuple[list[Message], list[dict]]]:
        out = []
        for i, row in enumerate(rows):
            for j in range(g):
                env = envs[(offset + i) * g + j] = make_env()
                out.append((list(env.reset(row)), [t.schema() for t in env.tools]))
        return out

    try:
        firsts = share(reset_all)
        episodes = []
        for k, (messages, tools) in enumerate(firsts):
            i = k // g
            episodes.append(_Episode(key=(offset + i) * g + k % g, prompt_index=offset + i,
                                     prompt_ids=codec.first_ids(messages, tools), messages=messages,
                                     tools=tools))
        seconds, logprobs_mode = 0.0, "raw_logprobs"
        for turn in range(limits.max_turns):
            active = [e for e in episodes if e.finish is None]
            if any_active is not None and not any_active(bool(active)):
                break
            if not active and any_active is None:
                break
            samples, seconds_turn, mode = _sample_turn(generate, codec, one, limits, active, step, turn, dummy_ids)
            seconds += seconds_turn
            logprobs_mode = mode or logprobs_mode
            _apply_turn(codec, active, samples, limits, turn, envs, share)
        for e in episodes:
            if e.finish is None:
                e.finish = "turns"
    finally:
        for env in envs.values():
            env.close()
    return _to_batch(codec, episodes, g, seconds, logprobs_mode, limits.error_reward)


def _sample_turn(generate, codec: TurnCodec, one: SamplingConfig, limits: EpisodeLimits,
                 active: list[_Episode], step: int, turn: int,
                 dummy_ids: Optional[list[int]]) -> tuple[dict, float, Optional[str]]:
    """One generate call for every active episode whose next turn fits its budgets (the
    others end, finish "length"); a replica with none samples a discarded dummy token."""
    runnable = []
    for e in active:
        left = room(e, limits)
        if left < 1:
            e.finish = "length"
        else:
            runnable.append((e, min(left, one.max_new_tokens)))
    if not runnable:
        if dummy_ids:
            generate([dummy_ids], one, step=step, keys=[0], budgets=[1])
        return {}, 0.0, None
    out = generate([e.prompt_ids + e.ids for e, _ in runnable], one, step=step * TURN_SEED_STRIDE + turn,
                   keys=[e.key for e, _ in runnable], budgets=[b for _, b in runnable])
    samples = {e.key: (list(out.response_ids[i]), list(out.logprobs[i]), out.finish_reasons[i])
               for i, (e, _) in enumerate(runnable)}
    seconds, mode = out.seconds, out.logprobs_mode
    return samples, seconds, mode


def _apply_turn(codec: TurnCodec, active: list[_Episode], samples: dict, limits: EpisodeLimits, turn: int,
                envs: dict[int, Environment], share) -> None:
    """Append each sampled turn, let the environments answer (on the replica's first rank),
    and append their replies' ids where the episode goes on."""
    sampled = [e for e in active if e.key in samples]
    for e in sampled:
        take_turn(codec, e, *samples[e.key])
    answered = [e for e in sampled if e.finish is None]
    if not answered:
        return

    def step_all() -> list[dict]:
        return step_envs([(envs[e.key], e.messages[-1]) for e in answered], limits, turn)

    for e, r in zip(answered, share(step_all)):
        take_reply(codec, e, r, limits)


def room(e: _Episode, limits: EpisodeLimits) -> int:
    """Tokens the episode's next turn may take: its token budget and the engine's context."""
    return min(limits.max_tokens - len(e.ids), limits.max_model_len - len(e.prompt_ids) - len(e.ids))


def take_turn(codec: TurnCodec, e: _Episode, ids: list[int], lps: list[float], finish: str,
              versions: Optional[list[int]] = None) -> None:
    """Append one sampled turn to its episode and parse it into the conversation;
    ``versions``: per token, the policy version that sampled it (a stamping engine)."""
    e.add("model", ids, lps, versions)
    e.turns += 1
    msg = codec.parse(ids)
    e.messages.append(msg)
    e.text = str(msg.get("content") or "")
    e.tool_calls += len(msg.get("tool_calls") or [])
    e.cut.append(finish == "length")
    if finish == "length":
        e.finish = "length"  # a cut turn is not an answer nor a call: not shown to the env


def take_reply(codec: TurnCodec, e: _Episode, r: dict, limits: EpisodeLimits) -> None:
    """The environment's answer (``step_one``'s result) to the episode's last turn: its
    reward, and the episode's end or the reply's ids appended for the next turn."""
    e.reward += r["reward"]
    e.tool_errors += r["tool_errors"]
    if r["error"] is not None:
        e.finish, e.error = "error", r["error"]
    elif r["done"]:
        e.finish = "stop"
    elif e.turns >= limits.max_turns:
        e.finish = "turns"
    else:
        delta = codec.delta_ids(e.messages, r["messages"], e.tools)
        if len(e.ids) + len(delta) >= min(limits.max_tokens, limits.max_model_len - len(e.prompt_ids)):
            e.finish = "length"  # no room left for the model to answer the reply
        else:
            e.messages.extend(r["messages"])
            e.add("env", delta)


def step_one(env: Environment, message: Message) -> dict:
    """``env.step(message)`` as a plain result; an exception is the episode's error, not the run's."""
    try:
        r = env.step(message)
        return {"messages": list(r.messages), "reward": float(r.reward), "done": bool(r.done),
                "tool_errors": int((r.info or {}).get("tool_errors", 0)), "error": None}
    except Exception as err:  # noqa: BLE001 - one environment's failure ends its episode only
        return _failed(f"env.step raised {type(err).__name__}: {err}")


def step_envs(work: list[tuple[Environment, Message]], limits: EpisodeLimits, turn: int) -> list[dict]:
    """``env.step(message)`` for each pair, as plain results in order (``error`` None, or
    why the step failed: it raised, outlasted ``limits.step_timeout_seconds``, or was
    unfinished when ``limits.env_budget_seconds`` ran out). Steps answering tool calls run
    in threads, ``limits.env_workers`` at once (each episode has its own environment, and
    the sandbox is thread-safe); the others (a final answer, scored by the rewards) run on
    the calling thread meanwhile, because a reward's timeout may need the main thread
    (math-verify's ``signal.alarm``). Never raises for what an environment does: one
    episode's failure is that episode's (those still running in threads finish in the
    background, their results ignored)."""
    started: dict[int, float] = {}

    def one(i: int) -> dict:
        started[i] = time.monotonic()
        return step_one(*work[i])

    budget, timeout = limits.env_budget_seconds, limits.step_timeout_seconds
    deadline = None if budget is None else time.monotonic() + budget
    calls = [i for i, (_, message) in enumerate(work) if message.get("tool_calls")]
    results: dict[int, dict] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(limits.env_workers, len(calls))), thread_name_prefix="env-step")
    try:
        futures = {i: pool.submit(one, i) for i in calls}
        for i in range(len(work)):
            if i not in futures:
                results[i] = one(i)
        pending = dict(futures)
        while pending:
            now = time.monotonic()
            ends = [deadline] if deadline is not None else []
            if timeout is not None:  # a step not started yet is looked at again shortly
                ends += [started[i] + timeout if i in started else now + _POLL_S for i in pending]
            left = None if not ends else max(0.0, min(ends) - now) + 1e-3
            done, _ = wait(pending.values(), timeout=left, return_when=FIRST_COMPLETED)
            now = time.monotonic()
            for i, f in list(pending.items()):
                if f in done:
                    results[i] = f.result()
                elif timeout is not None and i in started and now >= started[i] + timeout:
                    results[i] = _failed(f"env.step outlasted env.step_timeout_seconds={timeout:g}")
                elif deadline is not None and now >= deadline:
                    results[i] = _failed(
                        f"env.step unfinished when the environment steps of turn {turn} outlasted "
                        f"env.turn_budget_seconds={budget:g} ({limits.env_workers} at once): raise "
                        "--env.tool_workers, lower the tools' own limits or raise --env.turn_budget_seconds")
                else:
                    continue
                del pending[i]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for i, r in results.items():
        if r["error"] is not None:
            log.warning("multi-turn environment error (turn %d, step %d of %d): %s", turn, i, len(work), r["error"])
    return [results[i] for i in range(len(work))]


_POLL_S = 0.05
"""How often a step's own timeout is looked at while steps queued behind the workers start."""


def _failed(error: str) -> dict:
    return {"messages": [], "reward": 0.0, "done": True, "tool_errors": 0, "error": error}


def _to_batch(codec: TurnCodec, episodes: list[_Episode], g: int, seconds: float,
              logprobs_mode: str, error_reward: Optional[float] = 0.0) -> RolloutBatch:
    """The episodes as one batch; a group with an episode that is not token-exact (or that
    an environment error ended, when ``error_reward`` is None) is kept in the batch for its
    shape and metrics but dropped from training: every mask entry 0."""
    batch = RolloutBatch(prompt_ids=[], response_ids=[], logprobs=[], finish_reasons=[], prompt_index=[],
                         group_size=g, logprobs_mode=logprobs_mode, seconds=seconds)
    problems = [codec.check(e.prompt_ids, e.segments, e.messages, e.tools, e.ids, e.mask, e.cut)
                for e in episodes]
    for e, p in zip(episodes, problems):
        if p:  # counted in the metrics; the first one of each episode is logged, whole
            log.warning("multi-turn episode %d (prompt %d) is not token-exact, its group is dropped: %s",
                        e.key, e.prompt_index, p[0])
        if e.error is not None and error_reward is not None:
            e.reward = float(error_reward)
    dropped = {k // g for k, (e, p) in enumerate(zip(episodes, problems))
               if p or (e.error is not None and error_reward is None)}
    # Asynchronous GRPO: each turn's tokens keep the version that sampled them, so an episode
    # that spans weight updates carries several (the staleness bound is per token).
    stamped = any(e.versions is not None for e in episodes)
    for k, (e, p) in enumerate(zip(episodes, problems)):
        drop = k // g in dropped
        batch.prompt_ids.append(e.prompt_ids)
        batch.response_ids.append(e.ids)
        batch.logprobs.append(e.logprobs)
        batch.response_mask.append([0] * len(e.mask) if drop else e.mask)
        batch.finish_reasons.append(e.finish or "turns")
        batch.stop_reasons.append(None)
        batch.prompt_index.append(e.prompt_index)
        batch.texts.append(e.text)
        batch.episode_rewards.append(0.0 if e.error is not None and error_reward is None else e.reward)
        if stamped:
            batch.versions.append(list(e.versions or []))
        batch.episode_info.append({"turns": e.turns, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
                                   "env_tokens": len(e.mask) - sum(e.mask),
                                   "token_mismatch": len(p), "problems": p[:3],
                                   "env_error": int(e.error is not None), "error": e.error,
                                   "dropped": int(drop)})
    return batch
