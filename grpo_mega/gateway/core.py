"""The gateway without HTTP: episodes, the chat call, rewards, and the trainer's batch.

:class:`Gateway` is what the HTTP layer (``gateway.http``) calls and what a trainer holds:
``open_episode`` / ``chat`` / ``set_reward`` / ``finish`` / ``collect``. Each chat call is served
under its episode's lock (an episode is one conversation; its calls are ordered), generation goes
through the one engine thread (``gateway.batcher``), and the record is updated only after the
engine answered (a failed call leaves the episode as it was)."""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
import secrets
import string
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

from grpo_mega.envs.types import Message
from grpo_mega.gateway.batcher import Batcher, Job, Sampled
from grpo_mega.gateway.config import GatewayConfig
from grpo_mega.gateway.episode import Episode, Rewrite
from grpo_mega.gateway.openai_api import (ChatRequest, GatewayError, completion_response, normalize_message,
                                          parse_chat_request)
from grpo_mega.rollout.multi_turn import TurnCodec
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig

__all__ = ["Gateway", "EPISODE_ID"]

log = logging.getLogger(__name__)

EPISODE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
"""Episode ids (they sit in URLs)."""
_KEY_STRIDE = 1 << 20
"""Call k of the episode with seed key n (``open_episode(key=)``, else the order it was
opened in) draws its seed with key ``n * _KEY_STRIDE + k``."""
_SAMPLED = ("temperature", "top_p", "top_k")
"""The fields that set the sampling distribution the recorded log-probs describe."""
_ALNUM = string.ascii_letters + string.digits
_MAX_ABS_REWARD = 1e6
"""Largest reward magnitude accepted: the group's advantages must stay finite and
meaningful (the trainer's rewards are float32: a reported 1e39 is inf there, which stops
the run; in float64 1e308 overflows the variance and zeroes the group's advantages)."""
_REMEMBER = 100_000
"""Collected episode ids remembered, so that a late call to one is refused rather than
opening a new episode nobody will collect."""


def _canonical(field: str, value: Any) -> Any:
    """A sampling field's value in one form (top-k: 0 and -1 both disable it)."""
    return max(int(value), 0) if field == "top_k" else float(value)


def _reward(reward: Any) -> float:
    """A reported reward as a float; 400 unless a finite number within ``_MAX_ABS_REWARD``."""
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) \
            or abs(reward) > _MAX_ABS_REWARD:
        raise GatewayError(400, f"reward={reward!r} must be a finite number within +-{_MAX_ABS_REWARD:g}",
                           param="reward")
    return float(reward)


def _call_id() -> str:
    # 9 letters and digits: the one form every template accepts (Mistral's requires it).
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class Gateway:
    """Records token-exact episodes of agents calling an OpenAI-style chat API.

    Args:
        generate: ``generate(prompt_id_lists, sampling, step=, keys=, budgets=) -> RolloutBatch``,
            e.g. ``RolloutEngine.generate`` of an in-process or child-mode engine of one rank.
            The gateway calls it from one thread of its own; nothing else may use the engine
            while episodes run (sync weights between rounds). None: the caller pumps the
            calls (``batcher.take``; the trainer, collectively over its ranks).
        codec: the chat format (``TurnCodec``: ``first_ids``, ``delta_ids``, ``parse``, ``check``).
        sampling: defaults for what a request leaves out (its ``n`` is ignored: one choice per
            call). The chat format's end-of-turn token (``codec.eot_id``) is added to its
            ``stop_token_ids``, so that a reply ends where its turn ends.
        config: :class:`GatewayConfig`.
    """

    def __init__(self, generate: Optional[Callable[..., RolloutBatch]], codec: TurnCodec,
                 sampling: Optional[SamplingConfig] = None, config: Optional[GatewayConfig] = None):
        self.codec = codec
        self.set_sampling(sampling or SamplingConfig())
        self.config = config or GatewayConfig()
        self.batcher = Batcher(generate, max_batch=self.config.max_batch, wait_s=self.config.batch_wait_s)
        self.step = 0
        """Feeds the seeds of calls that bring none (set it to the training step before a round)."""
        self.created = int(time.time())
        self._episodes: dict[str, Episode] = {}
        self._collected: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._serial = 0
        self._lock = threading.Condition()
        self._tasks: collections.deque[dict] = collections.deque()
        self._tasks_ended = False

    def set_sampling(self, sampling: SamplingConfig) -> None:
        """The sampling of the calls from now on (the trainer's, set per round: training at
        ``rollout.temperature``, greedy evaluation). The chat format's end-of-turn token is
        added to its ``stop_token_ids``, so that a reply ends where its turn ends."""
        self.sampling = dataclasses.replace(sampling, n=1, stop_token_ids=tuple(sorted(
            {*sampling.stop_token_ids, self.codec.eot_id})))

    # -- episodes ------------------------------------------------------------
    def open_episode(self, episode_id: Optional[str] = None, *, prompt_index: Optional[int] = None,
                     metadata: Optional[dict] = None, key: Optional[int] = None,
                     task: Optional[dict] = None) -> str:
        """Open an episode (a fresh id unless one is given); returns its id. ``prompt_index``:
        the prompt it plays (``collect`` groups by it); ``metadata``: JSON-able, kept in
        ``episode_info``; ``key``: its seed key (distinct per episode of a round; default:
        the order episodes were opened in), so that with the same ``step`` and seed a round
        draws the same samples however its agents' calls interleave. ``task``: JSON-able,
        handed with the episode's id to the next agent asking (``next_task``)."""
        if episode_id is None:
            episode_id = uuid.uuid4().hex
        if not isinstance(episode_id, str) or not EPISODE_ID.match(episode_id):
            raise GatewayError(400, f"episode id {episode_id!r} must be 1-128 letters, digits, '_', '.' or '-'",
                               param="id")
        if prompt_index is not None and (isinstance(prompt_index, bool) or not isinstance(prompt_index, int)
                                         or prompt_index < 0):
            raise GatewayError(400, f"prompt_index={prompt_index!r} must be an integer >= 0", param="prompt_index")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 40):
            raise GatewayError(400, f"key={key!r} must be an integer in [0, 2**40)", param="key")
        with self._lock:
            if episode_id in self._episodes:
                raise GatewayError(409, f"episode {episode_id!r} is already open", param="id",
                                   code="episode_exists")
            if episode_id in self._collected:
                raise GatewayError(409, f"episode {episode_id!r} was collected for training; open a new one",
                                   param="id", code="episode_collected")
            if len(self._episodes) >= self.config.max_open_episodes:
                raise GatewayError(429, f"{len(self._episodes)} episodes are held already, the most "
                                   f"GatewayConfig.max_open_episodes allows; collect or discard finished ones "
                                   "(Gateway.collect / Gateway.discard) before opening more",
                                   param="id", code="too_many_episodes")
            ep = self._episodes[episode_id] = Episode(episode_id, self._serial if key is None else key,
                                                      prompt_index, metadata)
            ep.task = task
            self._serial += 1
            if task is not None:
                self._tasks.append({"episode_id": episode_id, "prompt_index": prompt_index, **task})
                self._lock.notify_all()
        return episode_id

    def next_task(self, wait: float) -> Optional[dict]:
        """The oldest task not yet handed out (``open_episode(task=)``), waiting up to
        ``wait`` s for one; None if none came; a 410 (``tasks_ended``) once ``end_tasks`` ran."""
        deadline = time.monotonic() + wait
        with self._lock:
            while not self._tasks and not self._tasks_ended and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            if self._tasks:
                return self._tasks.popleft()
            if self._tasks_ended:
                raise GatewayError(410, "the run is over: no more episodes (the agent may exit)", code="tasks_ended")
            return None

    def end_tasks(self) -> None:
        """No more tasks: agents asking get 410 and may exit."""
        with self._lock:
            self._tasks_ended = True
            self._lock.notify_all()

    def unfinished(self, episode_ids: Sequence[str]) -> list[str]:
        """The ids among ``episode_ids`` still held and not finished."""
        with self._lock:
            return [i for i in episode_ids if i in self._episodes and not self._episodes[i].finished]

    def busy(self, episode_ids: Sequence[str]) -> list[str]:
        """The ids among ``episode_ids`` with a call being served (its episode's lock held):
        a pumped gateway must serve these before ``collect``, which waits for them."""
        with self._lock:
            eps = [self._episodes.get(i) for i in episode_ids]
        return [e.id for e in eps if e is not None and e.lock.locked()]

    def expire(self, episode_ids: Sequence[str], reason: str) -> list[str]:
        """End the unfinished episodes among ``episode_ids`` for the trainer (an agent past
        its time): later calls get 409, a call already being served still completes, and
        ``collect`` scores them ``error_reward``. Returns the ids ended. Takes no
        episode's lock (a call holding one may wait for the pump that calls this)."""
        ended = []
        with self._lock:
            for i in episode_ids:
                ep = self._episodes.get(i)
                if ep is not None and not ep.finished:
                    ep.error, ep.finished = reason, True
                    ended.append(i)
            self._tasks = collections.deque(t for t in self._tasks if t["episode_id"] not in set(ended))
            self._lock.notify_all()
        return ended

    def episode(self, episode_id: str, *, create: bool = False) -> Episode:
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None and create and self.config.auto_open:
            try:
                self.open_episode(episode_id)
            except GatewayError as e:
                if e.code != "episode_exists":  # another thread opened it meanwhile
                    raise
            return self.episode(episode_id)
        if ep is None:
            raise GatewayError(404, f"no open episode {episode_id!r} (open it with POST /episodes or "
                               "Gateway.open_episode; collected episodes are gone)", code="episode_not_found")
        return ep

    def set_reward(self, episode_id: str, reward: Any) -> None:
        """The episode's reward (a later report replaces an earlier one until it is finished)."""
        self._set(episode_id, _reward(reward), finish=False)

    def finish(self, episode_id: str, reward: Any = None) -> None:
        """Close the episode (later chat calls get 409, and so does a second finish or a
        reward reported after it); optionally report its reward."""
        self._set(episode_id, None if reward is None else _reward(reward), finish=True)
        with self._lock:
            self._lock.notify_all()

    def _set(self, episode_id: str, reward: Optional[float], finish: bool) -> None:
        ep = self.episode(episode_id)
        with ep.lock:
            if ep.finished:  # its reward is fixed: the trainer may be collecting it
                why = f" by the trainer ({ep.error})" if ep.error else ""
                raise GatewayError(409, f"episode {episode_id!r} is finished{why}; its reward cannot change",
                                   code="episode_finished")
            if reward is not None:
                ep.reward = reward
            ep.finished = ep.finished or finish

    def discard(self, episode_id: str) -> None:
        """Forget an episode (an agent that crashed before its first call)."""
        with self._lock:
            self._episodes.pop(episode_id, None)

    def wait(self, episode_ids: Sequence[str], timeout: Optional[float] = None) -> bool:
        """Block until every episode is finished (``POST /episodes/<id>/finish``); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                pending = [i for i in episode_ids if i in self._episodes and not self._episodes[i].finished]
                if not pending:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)

    # -- the chat call -------------------------------------------------------
    def chat(self, episode_id: str, body: Any) -> dict:
        """Serve one ``/chat/completions`` body for the episode; returns the response object.
        Raises :class:`GatewayError` for anything it refuses or fails."""
        req = parse_chat_request(body)
        ep = self.episode(episode_id, create=True)
        with ep.lock:
            if ep.finished:
                raise GatewayError(409, f"episode {episode_id!r} is finished; open a new one",
                                   code="episode_finished")
            if ep.tools and not req.tools:
                # A later call without tools (an agent's final "answer now" call): the tools stay
                # in the prompt, which was rendered with them, and the reply is served as text.
                req.tools, req.tool_choice = list(ep.tools), "none"
            plan = self._plan(ep, req)
            prompt = plan.engine_prompt(ep)
            sampling, step, key, overridden = self._sampling(req, ep)
            budget = self._budget(req, prompt, 0 if plan.restart else len(prompt) - len(ep.prompt_ids))
            ep.attempts += 1
            got = self._generate(Job(prompt, sampling, step, key, budget))
            closed = bool(got.ids) and got.ids[-1] == self.codec.eot_id
            stopped = not closed and got.finish == "stop" and isinstance(got.stop_reason, str)  # else cut: length
            parsed, shown = self._reply(got, req, stopped)
            ep.commit(plan, got.ids, got.logprobs, parsed, shown, closed, stopped)
            ep.sampling_overridden += overridden
            used = [getattr(sampling, k) for k in _SAMPLED]
            if used not in ep.sampling_used:
                ep.sampling_used.append(used)
            ep.logprobs_mode, ep.seconds = got.logprobs_mode, ep.seconds + got.seconds
        finish = ("length" if got.finish == "length" else
                  "tool_calls" if shown.get("tool_calls") else "stop")
        return completion_response(self.config.model_name, shown, finish, len(prompt), len(got.ids))

    def _plan(self, ep: Episode, req: ChatRequest):
        try:
            try:
                return ep.plan(self.codec, req.messages, req.tools)
            except Rewrite as why:
                if self.config.on_rewrite != "restart":
                    raise GatewayError(409, f"history rewritten in episode {ep.id!r}: {why} (or start the "
                                       "episode again with GatewayConfig.on_rewrite='restart')",
                                       param="messages", code="history_rewritten") from None
                return ep.plan_restart(self.codec, req.messages, req.tools)
        except ValueError as e:  # the chat format's ChatFormatError: a template refusing these messages
            raise GatewayError(400, f"the chat format cannot render these messages: {e}", param="messages",
                               code="unrenderable_messages") from None

    def _sampling(self, req: ChatRequest, ep: Episode) -> tuple[SamplingConfig, int, int, int]:
        """The call's sampling (the gateway's, whatever the request asked: the trainer owns
        it), step and seed key, and 1 if the request asked for something else (overridden)."""
        base = self.sampling
        asked = {k: getattr(req, k) for k in (*_SAMPLED, "seed") if getattr(req, k) is not None}
        differs = [k for k, v in asked.items() if k == "seed" or _canonical(k, v) != _canonical(k, getattr(base, k))]
        if differs and self.config.sampling_policy == "refuse":
            k = differs[0]
            why = ("the trainer draws each episode's seed (from its seed, the step and the episode), so that the "
                   "episodes of a group differ; leave seed unset" if k == "seed" else
                   f"the trainer samples at {k}={getattr(base, k)!r} and its loss assumes that distribution; "
                   f"leave {k} unset or send {getattr(base, k)!r}")
            raise GatewayError(400, f"{k}={asked[k]!r} is refused: {why} (or set gateway.sampling_policy=override, "
                               "GatewayConfig.sampling_policy, to serve such calls at the trainer's sampling)",
                               param=k, code="sampling_not_allowed")
        s = dataclasses.replace(base, stop=tuple(base.stop) + tuple(req.stop))
        return s, self.step, ep.serial * _KEY_STRIDE + ep.attempts, int(bool(differs))

    def _budget(self, req: ChatRequest, prompt: list[int], used: int) -> int:
        """The call's ``max_tokens``: the request's, clipped to the sampling's per-reply
        ``max_new_tokens``, to what the episode's budget leaves after the ``used`` tokens it
        holds after its first prompt, and to what the context leaves."""
        budget = self.sampling.max_new_tokens
        if req.max_tokens is not None:
            budget = min(budget, req.max_tokens)
        cap = self.config.max_episode_tokens
        if cap is not None:
            if cap - used < 1:
                raise GatewayError(400, f"the episode holds {used} tokens after its first prompt, its whole budget "
                                   f"(GatewayConfig.max_episode_tokens={cap}, the trainer's gateway.max_tokens); "
                                   "finish the episode", param="messages", code="episode_budget_exhausted")
            budget = min(budget, cap - used)
        limit = self.config.max_model_len
        if limit is not None:
            room = limit - len(prompt)
            if room < 1:
                raise GatewayError(400, f"the conversation is {len(prompt)} tokens, which leaves no room in the "
                                   f"engine's context of {limit} (GatewayConfig.max_model_len)",
                                   param="messages", code="context_length_exceeded")
            budget = min(budget, room)
        return budget

    def _generate(self, job: Job) -> Sampled:
        try:
            future = self.batcher.submit(job)
        except RuntimeError as e:
            raise GatewayError(503, f"{e}; no more calls are served", code="gateway_closed") from None
        try:
            return future.result(timeout=self.config.request_timeout_s)
        except FutureTimeout:
            raise GatewayError(504, f"the engine did not answer within {self.config.request_timeout_s} s "
                               "(GatewayConfig.request_timeout_s)", code="engine_timeout") from None
        except ValueError as e:  # the engine refuses the request as asked (length, sampling mode)
            raise GatewayError(400, f"the engine refused the call: {e}", code="engine_refused") from None
        except Exception as e:  # noqa: BLE001 - reported to the caller, logged here
            log.exception("gateway: generate failed")
            raise GatewayError(500, f"the engine failed: {type(e).__name__}: {e}", code="engine_error") from None

    def _reply(self, got: Sampled, req: ChatRequest, stopped: bool = False) -> tuple[Message, Message]:
        """The reply as the chat format renders it (``parsed``) and as the agent sees it
        (``shown``, normalised like a message the agent sends back). A reply ``stopped`` by
        a request's stop string is shown as the engine's text, which leaves the stop string
        out (OpenAI's and vLLM's ``content``), its tool calls not parsed (the stop string cut it)."""
        try:
            parsed = dict(self.codec.parse(list(got.ids)))
        except Exception as e:  # noqa: BLE001 - a chat-format bug must not kill the server
            log.exception("gateway: the chat format could not parse a reply")
            raise GatewayError(500, f"the chat format could not parse the reply: {type(e).__name__}: {e}",
                               code="parse_error") from None
        parsed["role"] = "assistant"
        calls = []
        for c in parsed.get("tool_calls") or []:
            fn = c.get("function", c)
            calls.append({"id": c.get("id") or _call_id(), "type": "function",
                          "function": {"name": fn["name"], "arguments": fn.get("arguments", {})}})
        if calls:
            parsed["tool_calls"] = calls
        if stopped:
            shown: Message = {"role": "assistant", "content": got.text}
        elif req.tool_choice == "none":
            # Like vLLM: the reply is not parsed for tool calls; the agent gets its whole text.
            shown = {"role": "assistant", "content": got.text or str(parsed.get("content") or "")}
        else:
            shown = {"role": "assistant", "content": str(parsed.get("content") or "")}
            if calls:
                shown["tool_calls"] = calls
            if parsed.get("reasoning_content"):
                shown["reasoning_content"] = parsed["reasoning_content"]
        return parsed, normalize_message(shown)

    # -- the trainer's side --------------------------------------------------
    def collect(self, episode_ids: Sequence[str], group_size: int = 1,
                default_reward: Optional[float] = None, error_reward: Optional[float] = 0.0) -> RolloutBatch:
        """The episodes as one ``RolloutBatch``, in the order given (group-major: the
        ``group_size`` episodes of prompt 0, then of prompt 1, ...), finished and removed from
        the gateway. ``prompt_index``: each episode's own, else its position // group_size.
        ``default_reward``: the reward of episodes that reported none (None: that is an error).
        Episodes ended by ``expire`` get ``error_reward`` (None: 0.0, and the caller drops
        their groups: ``episode_info["error"]`` names why); one with no call yet is a row of
        its task's prompt and one end-of-turn token, masked out (it keeps its group's shape).
        An episode with a call sampled at another temperature, top-p or top-k than the
        gateway's sampling now (``set_sampling`` changed it while the episode ran) is refused:
        its log-probs describe another distribution than the batch's."""
        ids = list(episode_ids)
        if group_size < 1 or len(ids) % group_size:
            raise ValueError(f"{len(ids)} episodes do not split into groups of group_size={group_size}")
        if len(set(ids)) != len(ids):
            raise ValueError("collect: an episode id is listed twice")
        eps = [self.episode(i) for i in ids]
        batch = RolloutBatch(prompt_ids=[], response_ids=[], logprobs=[], finish_reasons=[], prompt_index=[],
                             group_size=group_size)
        modes, problems = set(), []
        want = [_canonical(k, getattr(self.sampling, k)) for k in _SAMPLED]
        for k, ep in enumerate(eps):
            with ep.lock:  # waits for a call still running
                ep.finished = True
                if ep.error is not None:  # ended by the trainer: scored error_reward, never refused
                    row = self._error_row(ep)
                    ep.reward = float(error_reward) if error_reward is not None else 0.0
                    if ep.prompt_ids:
                        modes.add(ep.logprobs_mode)
                else:
                    why = self._unusable(ep, want, default_reward)
                    if why:
                        problems.append(f"{ep.id}: {why}")
                        continue
                    row = ep.sample(self.codec)
                    modes.add(ep.logprobs_mode)
                index = ep.prompt_index if ep.prompt_index is not None else k // group_size
            batch.prompt_ids.append(row["prompt_ids"])
            batch.response_ids.append(row["response_ids"])
            batch.logprobs.append(row["logprobs"])
            batch.response_mask.append(row["response_mask"])
            batch.finish_reasons.append(row["finish_reason"])
            batch.stop_reasons.append(None)
            batch.prompt_index.append(index)
            batch.texts.append(row["text"])
            batch.episode_rewards.append(ep.reward if ep.reward is not None else float(default_reward))
            batch.episode_info.append(row["info"])
            batch.seconds += ep.seconds
        if problems:
            raise ValueError("collect: " + "; ".join(problems))
        for g in range(0, len(ids), group_size):
            if len(set(batch.prompt_index[g:g + group_size])) != 1:
                raise ValueError(f"collect: episodes {ids[g:g + group_size]} form one group but play prompts "
                                 f"{batch.prompt_index[g:g + group_size]}; list them group-major")
        if len(modes) > 1:
            raise ValueError(f"collect: the episodes' log-probs come from different modes {sorted(modes)}")
        batch.logprobs_mode = modes.pop() if modes else batch.logprobs_mode
        with self._lock:
            for i in ids:
                self._episodes.pop(i, None)
                self._collected[i] = None
            while len(self._collected) > _REMEMBER:
                self._collected.popitem(last=False)
            self._lock.notify_all()
        return batch

    @staticmethod
    def _unusable(ep: Episode, want: list, default_reward: Optional[float]) -> Optional[str]:
        """Why ``collect`` cannot train the episode as it stands (None: it can)."""
        if not ep.prompt_ids:
            return "no chat call (discard it, or let its agent run)"
        if ep.reward is None and default_reward is None:
            return f"no reward reported (POST /episodes/{ep.id}/reward, or pass default_reward)"
        other = [u for u in ep.sampling_used if [_canonical(k, v) for k, v in zip(_SAMPLED, u)] != want]
        if other:
            return f"sampled at (temperature, top_p, top_k) {other[0]}, not the trainer's {want}; discard it"
        return None

    def _error_row(self, ep: Episode) -> dict[str, Any]:
        """An ended episode's sample: its trajectory so far, or, with no call served, its
        task's prompt and one end-of-turn token, masked out (nothing to train, one row kept
        for the group's shape)."""
        if ep.prompt_ids:
            return ep.sample(self.codec)
        messages = list((ep.task or {}).get("messages") or [])
        try:
            prompt = list(self.codec.first_ids(messages, [])) if messages else [self.codec.eot_id]
        except ValueError:  # a template refusing the task's messages: the row is masked out anyway
            prompt = [self.codec.eot_id]
        info = {"episode_id": ep.id, "turns": 0, "tool_calls": 0, "tool_errors": 0, "env_tokens": 0,
                "token_mismatch": 0, "problems": [], "calls": 0, "rewinds": 0, "restarts": 0,
                "dropped_model_tokens": 0, "sampling": [], "sampling_overridden": 0,
                "reward_reported": False, "metadata": ep.metadata, "env_error": 1, "error": ep.error}
        return {"prompt_ids": prompt, "response_ids": [self.codec.eot_id], "logprobs": [0.0],
                "response_mask": [0], "finish_reason": "error", "text": "", "info": info}

    def close(self) -> None:
        """Stop the engine thread (the HTTP server is closed by its own ``close``)."""
        self.end_tasks()
        self.batcher.close()

    def serve(self, host: Optional[str] = None, port: Optional[int] = None):
        """Start the HTTP server on a thread (``config.host``/``port`` unless given); returns
        the :class:`~grpo_mega.gateway.http.GatewayServer` (a context manager)."""
        from grpo_mega.gateway.http import GatewayServer

        return GatewayServer(self, self.config.host if host is None else host,
                             self.config.port if port is None else port)
