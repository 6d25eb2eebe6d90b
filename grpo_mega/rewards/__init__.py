"""Rule-based rewards: a registry of scoring functions, a sandboxed scorer and
DAPO-style dynamic sampling.

What:
* A reward function has the signature
  ``fn(prompt: str, completion: str, reference: str | None, metadata: dict, **kwargs) -> float``.
  Built-ins are registered by name with :func:`register_reward`
  (``math``, ``format``, ``dapo_overlong``, ``length``); a custom function is
  named ``"package.module:function"`` and imported on use.
* :class:`RewardScorer` scores a batch of samples as a weighted sum of reward
  functions in a pool of worker processes, with a per-sample timeout. A
  function that raises or times out is reported with the sample's index and
  the exception. ``on_error="raise"`` (the default) stops the run with a
  :class:`RewardError`; ``on_error="zero"`` scores the sample 0 and counts it.
* :func:`filter_uniform_groups` is DAPO's dynamic sampling as a pure
  function: groups whose rewards are all equal carry no GRPO signal.

Why a process pool of our own rather than ``ProcessPoolExecutor``: a reward
stuck in an infinite loop must not hold a worker forever, so a worker that
overruns its deadline is killed and replaced; the executor cannot do that.
Workers are started with ``spawn`` (the trainer process holds threads and a
vLLM engine, which ``fork`` would copy in an undefined state).

The rollout adds two keys to each sample's metadata (copied, never mutated):
``response_length`` (tokens) and ``finish_reason`` ("stop" or "length"); the
length penalties read them.

How to run (tests)::

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rewards/test_rewards.py
"""
from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import re
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "RewardFn", "REWARD_REGISTRY", "register_reward", "resolve_reward",
    "RewardSpec", "RewardSample", "RewardFailure", "RewardResult", "RewardError",
    "RewardScorer", "score_samples",
    "extract_answer", "parse_number", "answers_equivalent",
    "math_reward", "format_reward", "dapo_overlong_reward", "length_reward",
    "GroupFilter", "filter_uniform_groups",
]

RewardFn = Callable[..., float]
REWARD_REGISTRY: dict[str, RewardFn] = {}
ON_ERROR_POLICIES = ("raise", "zero")


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
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward {name!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AttributeError(f"reward {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn


# ---------------------------------------------------------------------------
# Answer extraction and comparison
# ---------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_HASH_RE = re.compile(r"####\s*(.+)")
# A latex fraction, a thousands-grouped number, or a plain number / a/b.
_NUMBER_RE = re.compile(
    r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"
    r"|-?\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|-?\.\d+"
)
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac(\d)(\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    starts = [m for m in _BOXED_RE.finditer(text)]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
            continue  # unbalanced: try an earlier one
        # "\boxed 5" form: up to the next whitespace or "$"
        tail = re.match(r"[^\s$]+", text[i:])
        if tail:
            return tail.group(0)
    return None


def _after_hashes(text: str) -> str | None:
    matches = _HASH_RE.findall(text)
    if not matches:
        return None
    return matches[-1].strip().splitlines()[0].strip() if matches[-1].strip() else None


def _last_number(text: str) -> str | None:
    found = _NUMBER_RE.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, allow_last_number: bool = True) -> str | None:
    """The final answer in a completion: ``\\boxed{}``, then ``####``, then
    (if allowed) the last number; None when there is none."""
    for extract in (_last_boxed, _after_hashes):
        ans = extract(text)
        if ans:
            return ans
    return _last_number(text) if allow_last_number else None


def _normalize(ans: str) -> str:
    s = ans.strip()
    s = _TEXT_RE.sub(r"\1", s)  # \text{(A)} -> (A)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "^\\circ", "^{\\circ}"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".").strip()


def parse_number(ans: str) -> Fraction | None:
    """Exact value of a numeric answer: ``1,234``, ``-0.5``, ``3/4``,
    ``\\frac{3}{4}``, ``1e3``, ``50\\%`` (as 50); None if not a number."""
    s = _normalize(ans)
    s = s.replace("\\%", "").replace("%", "")
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    m = _FRAC_RE.fullmatch(s.lstrip("-"))
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if s.startswith("-") else value
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if s.count("/") == 1:
        a, b = (parse_number(part) for part in s.split("/"))
        return None if a is None or b is None or b == 0 else a / b
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equivalent(pred: str, ref: str, rel_tol: float = 1e-6) -> bool:
    """Numeric equivalence when both parse as numbers, else string equality
    after normalisation (whitespace, ``$``, ``\\left``/``\\right``, ...)."""
    a, b = parse_number(pred), parse_number(ref)
    if a is not None and b is not None:
        if a == b:
            return True
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=0.0)
    return _normalize(pred) == _normalize(ref)


def _reference_answer(reference: str) -> str:
    # A reference is either a bare answer ("\frac{1}{2}", "72") or a worked
    # solution ending in "#### 72" / "\boxed{72}"; never take its "last
    # number" (that would read "2" out of "\frac{1}{2}").
    return extract_answer(reference, allow_last_number=False) or reference.strip()


# ---------------------------------------------------------------------------
# Built-in reward functions
# ---------------------------------------------------------------------------

@register_reward("math")
def math_reward(prompt: str, completion: str, reference: str | None, metadata: Mapping[str, Any],
                correct: float = 1.0, incorrect: float = 0.0, allow_last_number: bool = True) -> float:
    """``correct`` if the completion's final answer equals the reference."""
    if reference is None:
        raise ValueError("math reward needs a reference answer (set the dataset's reference field)")
    pred = extract_answer(completion, allow_last_number=allow_last_number)
    if pred is None:
        return incorrect
    return correct if answers_equivalent(pred, _reference_answer(str(reference))) else incorrect


@register_reward("format")
def format_reward(prompt: str, completion: str, reference: str | None, metadata: Mapping[str, Any],
                  pattern: str | None = None, reward: float = 1.0) -> float:
    """``reward`` if the completion matches ``pattern`` (``re.search``, DOTALL);
    by default, if it states an explicit answer (``\\boxed{}`` or ``####``)."""
    if pattern is not None:
        return reward if re.search(pattern, completion, flags=re.DOTALL) else 0.0
    explicit = extract_answer(completion, allow_last_number=False)
    return reward if explicit else 0.0


def _response_length(metadata: Mapping[str, Any]) -> int:
    if "response_length" not in metadata:
        raise KeyError("length rewards need metadata['response_length'] (set by the rollout)")
    return int(metadata["response_length"])


@register_reward("dapo_overlong")
def dapo_overlong_reward(prompt: str, completion: str, reference: str | None,
                         metadata: Mapping[str, Any], max_length: int, buffer: int,
                         penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    0 while ``L <= max_length - buffer``; falls linearly to ``-penalty`` at
    ``L = max_length``; ``-penalty`` beyond. ``max_length`` is normally the
    rollout's max new tokens.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"dapo_overlong needs 0 < buffer <= max_length, got {buffer}, {max_length}")
    length = _response_length(metadata)
    safe = max_length - buffer
    if length <= safe:
        return 0.0
    if length <= max_length:
        return penalty * (safe - length) / buffer
    return -penalty


@register_reward("length")
def length_reward(prompt: str, completion: str, reference: str | None, metadata: Mapping[str, Any],
                  max_length: int, coef: float = 1.0, truncated_penalty: float = 0.0) -> float:
    """Linear length penalty ``-coef * L / max_length``, plus
    ``-truncated_penalty`` when the response hit the token limit."""
    length = _response_length(metadata)
    value = -coef * length / max_length
    if metadata.get("finish_reason") == "length":
        value -= truncated_penalty
    return value


# ---------------------------------------------------------------------------
# Scoring a batch in worker processes
# ---------------------------------------------------------------------------

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


@dataclass
class RewardSample:
    prompt: str
    completion: str
    reference: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class RewardFailure:
    index: int
    """Index of the sample in the batch passed to ``score``."""
    kind: str
    """"error" (the function raised), "timeout" or "crash" (the worker died)."""
    reward: str | None
    message: str
    traceback: str = ""

    def describe(self) -> str:
        where = f"reward {self.reward!r}" if self.reward else "reward"
        return f"sample {self.index}: {where} {self.kind}: {self.message}"


@dataclass
class RewardResult:
    scores: list[float]
    """Total reward per sample: sum of weight * component."""
    components: dict[str, list[float]]
    """Unweighted value of each reward term, per sample (0 where it failed)."""
    failures: list[RewardFailure]
    seconds: float = 0.0

    @property
    def num_errors(self) -> int:
        return sum(f.kind != "timeout" for f in self.failures)

    @property
    def num_timeouts(self) -> int:
        return sum(f.kind == "timeout" for f in self.failures)


class RewardError(RuntimeError):
    """A reward function raised or timed out and ``on_error="raise"``."""

    def __init__(self, failures: Sequence[RewardFailure]):
        self.failures = list(failures)
        lines = [f.describe() for f in self.failures[:5]]
        if len(self.failures) > 5:
            lines.append(f"... and {len(self.failures) - 5} more")
        detail = self.failures[0].traceback.strip()
        msg = (f"{len(self.failures)} reward failure(s):\n  " + "\n  ".join(lines)
               + ("\nfirst traceback:\n" + detail if detail else "")
               + "\n(set reward on_error='zero' to score such samples 0 and continue)")
        super().__init__(msg)


def _evaluate(specs: Sequence[RewardSpec], fns: Sequence[RewardFn], sample: RewardSample):
    """Run every reward on one sample: ("ok", values) or ("error", name, msg, tb)."""
    values = []
    for spec, fn in zip(specs, fns):
        try:
            value = float(fn(sample.prompt, sample.completion, sample.reference,
                             dict(sample.metadata), **dict(spec.kwargs)))
        except Exception as e:  # noqa: BLE001 - any user error is reported, not raised here
            return ("error", spec.name, f"{type(e).__name__}: {e}", traceback.format_exc())
        if not math.isfinite(value):
            return ("error", spec.name, f"returned non-finite value {value}", "")
        values.append(value)
    return ("ok", values)


def _worker_main(conn: Connection, specs: Sequence[RewardSpec]) -> None:
    try:
        fns = [resolve_reward(s.name) for s in specs]
    except Exception as e:  # noqa: BLE001 - e.g. a custom module importable in the parent only
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        index, sample = msg
        conn.send(("result", (index, _evaluate(specs, fns, sample))))


class _Worker:
    def __init__(self, ctx, specs: Sequence[RewardSpec]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, list(specs)), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.task: tuple[int, float] | None = None  # (sample index, deadline)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=2)
        self.kill()


class RewardScorer:
    """Scores samples with a weighted sum of reward functions.

    ``num_workers=0`` evaluates in this process (for debugging: the timeout
    is then not enforced). Workers start on first use and live until
    :meth:`close` (also a context manager).
    """

    def __init__(self, rewards: Sequence[RewardSpec | str | Mapping[str, Any]], *,
                 num_workers: int = 2, timeout_s: float = 10.0, on_error: str = "raise",
                 mp_context: str = "spawn"):
        if not rewards:
            raise ValueError("RewardScorer needs at least one reward")
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"reward on_error={on_error!r}; choose one of {ON_ERROR_POLICIES}")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.specs = [RewardSpec.coerce(r) for r in rewards]
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate reward names {names}; give each term once")
        # Resolve here too, so a typo in the config fails before any rollout.
        self._fns = [resolve_reward(s.name) for s in self.specs]
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = 120.0
        self.on_error = on_error
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker] = []

    # -- lifecycle -------------------------------------------------------
    def _ensure_workers(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.specs))

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- scoring ---------------------------------------------------------
    def score(self, samples: Sequence[RewardSample]) -> RewardResult:
        start = time.perf_counter()
        outcomes = (self._score_inline(samples) if self.num_workers == 0
                    else self._score_in_pool(samples))
        result = self._assemble(outcomes, len(samples))
        result.seconds = time.perf_counter() - start
        if result.failures and self.on_error == "raise":
            raise RewardError(result.failures)
        return result

    def _score_inline(self, samples: Sequence[RewardSample]) -> dict[int, tuple]:
        return {i: _evaluate(self.specs, self._fns, s) for i, s in enumerate(samples)}

    def _score_in_pool(self, samples: Sequence[RewardSample]) -> dict[int, tuple]:
        self._ensure_workers()
        pending = deque(range(len(samples)))
        outcomes: dict[int, tuple] = {}
        while pending or any(w.task for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    i = pending.popleft()
                    w.conn.send((i, samples[i]))
                    # The clock starts when a ready worker gets the sample:
                    # process start-up (seconds under load) is not the reward's.
                    w.task = (i, time.monotonic() + self.timeout_s)
            waiting = [w for w in self._workers if w.task or not w.ready]
            deadlines = [w.task[1] if w.task else w.started + self.startup_timeout_s for w in waiting]
            ready = wait([w.conn for w in waiting], timeout=max(0.0, min(deadlines) - time.monotonic()))
            for w in waiting:
                if w.conn in ready:
                    self._receive(w, outcomes)
            self._expire(outcomes)
        return outcomes

    def _receive(self, w: _Worker, outcomes: dict[int, tuple]) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                raise RuntimeError(f"reward worker died while starting (exit code {w.proc.exitcode})")
            outcomes[w.task[0]] = ("crash", None, f"reward worker died (exit code {w.proc.exitcode})", "")
            self._replace(w)
            return
        if kind == "fatal":
            raise RuntimeError(f"reward worker could not load the reward functions: {payload}")
        if kind == "ready":
            w.ready = True
            return
        index, outcome = payload
        assert w.task is not None and index == w.task[0], (index, w.task)
        outcomes[index] = outcome
        w.task = None

    def _expire(self, outcomes: dict[int, tuple]) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.task and now >= w.task[1]:
                names = ", ".join(s.name for s in self.specs)
                outcomes[w.task[0]] = ("timeout", None,
                                       f"no result within {self.timeout_s:g} s (rewards: {names}); "
                                       "worker killed", "")
                self._replace(w)
            elif not w.ready and now >= w.started + self.startup_timeout_s:
                raise RuntimeError(f"reward worker did not start within {self.startup_timeout_s:g} s")

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.specs)

    def _assemble(self, outcomes: Mapping[int, tuple], n: int) -> RewardResult:
        components = {s.name: [0.0] * n for s in self.specs}
        scores = [0.0] * n
        failures = []
        for i in range(n):
            outcome = outcomes[i]
            if outcome[0] != "ok":
                kind, name, msg, tb = outcome
                failures.append(RewardFailure(i, kind, name, msg, tb))
                continue  # failed sample scores 0 (on_error="zero")
            for spec, value in zip(self.specs, outcome[1]):
                components[spec.name][i] = value
                scores[i] += spec.weight * value
        return RewardResult(scores, components, failures)


def score_samples(samples: Sequence[RewardSample],
                  rewards: Sequence[RewardSpec | str | Mapping[str, Any]], **kwargs) -> RewardResult:
    """One-shot convenience: build a scorer, score, close it."""
    with RewardScorer(rewards, **kwargs) as scorer:
        return scorer.score(samples)


# ---------------------------------------------------------------------------
# DAPO dynamic sampling
# ---------------------------------------------------------------------------

@dataclass
class GroupFilter:
    kept_groups: list[int]
    """Indices of the groups (prompts) that keep a learning signal."""
    kept_samples: list[int]
    """Indices of their samples in the flat, group-major batch."""
    num_groups: int
    num_dropped: int

    @property
    def sample_indices(self) -> list[int]:
        """Alias of ``kept_samples`` (the name train.py uses)."""
        return self.kept_samples


def filter_uniform_groups(rewards: Sequence[float], group_size: int, tol: float = 0.0) -> GroupFilter:
    """Drop groups whose rewards are all equal (within ``tol``).

    rewards: [num_groups * group_size], group-major (sample ``g*group_size+j``
    is the j-th response to prompt g). Such groups have zero advantage for
    every sample, so they only dilute the batch (DAPO, "dynamic sampling").
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    num_groups = len(rewards) // group_size
    kept = []
    for g in range(num_groups):
        group = rewards[g * group_size:(g + 1) * group_size]
        if max(group) - min(group) > tol:
            kept.append(g)
    samples = [g * group_size + j for g in kept for j in range(group_size)]
    return GroupFilter(kept, samples, num_groups, num_groups - len(kept))
