"""Asynchronous GRPO with multi-turn episodes and DAPO (issue 40 deliverable 5), in-process.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/trainer/test_async_episodes_dapo.py

Stand-ins, no engine process: a turn engine that stamps each token with the policy version
of the step that decoded it (the weights move while episodes run), a ``RemoteEngines``
look-alike for ``RemoteEpisodes``, and for the pipeline a data cursor and engines whose
samples carry the version they were submitted at and the current one (an update in flight).
The trainer's real ``RolloutPipeline``, ``stages.rollout`` (DAPO's rounds) and staleness
split run on them.
"""
from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest

from grpo_mega.config import Config, load_config
from grpo_mega.rollout.multi_turn_async import run_episodes_async
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig
from grpo_mega.trainer.staleness import split_over_stale
from tests.unit.rollout.test_multi_turn_async import ROWS, Codec, SleepyEnv, StepEngine, _limits, _turn


class StampingEngine(StepEngine):
    """``StepEngine`` whose weights move every ``every`` engine steps (version = steps //
    every); each token is stamped with the version of the step that decoded it."""

    def __init__(self, every: int = 3):
        super().__init__()
        self.every, self.stamps = every, {}

    def step(self):
        version = self.steps // self.every
        for key in self.live:
            self.stamps.setdefault(key, []).append(version)
        done = super().step()
        return [(key, toks, lps, finish, self.stamps.pop(key)) for key, toks, lps, finish in done]


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, is_model) runs of the response mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_async_multi_turn_each_turn_keeps_the_versions_that_sampled_it():
    """Guards a multi-turn episode that spans weight updates losing its per-token version
    stamps across turns: stamps dropped (the turn taken without them: an empty ``versions``,
    which the staleness bound cannot read), only the last turn's kept, or the environment's
    tokens left out of the list (versions no longer aligned with the response). Each model
    token must carry the version of the engine step that decoded it, the environment's tokens
    the version before them, and some episode must span several versions."""
    engine = StampingEngine(every=2)
    decoded: dict[int, list[int]] = {}
    step_fn = engine.step

    def recording_step():
        done = step_fn()
        for key, _, _, _, stamps in done:
            decoded.setdefault(key, []).extend(stamps)
        return done

    engine.step = recording_step
    batch = run_episodes_async(engine, Codec(), SleepyEnv, ROWS, SamplingConfig(n=2, max_new_tokens=3),
                               _limits(), step=3)
    assert len(batch.versions) == len(batch) and max(i["turns"] for i in batch.episode_info) >= 2
    spans = []
    for k, (versions, ids, mask) in enumerate(zip(batch.versions, batch.response_ids, batch.response_mask)):
        assert len(versions) == len(ids), k
        model = [v for v, m in zip(versions, mask) if m]
        key = batch.prompt_index[k] * 2 + k % 2
        assert model == decoded.get(key, []), k  # every turn's own stamps, in order
        for start, end, is_model in _segments(mask):
            if not is_model:  # the environment's reply: the version of the token before it
                assert start > 0 and versions[start:end] == [versions[start - 1]] * (end - start), k
        spans.append(len(set(model)))
    assert max(spans) >= 2, spans  # an update landed between or inside turns


def test_async_multi_turn_staleness_bound_is_per_token_across_turns():
    """Guards the bound read per episode or from the last turn only: a group one of whose
    episodes sampled its first turn past the bound must be dropped (and played again) even
    though its later turns are fresh, while the environment's tokens (never trained) never
    count, however old their stamp. The episodes are the driver's (turns, tool replies, masks);
    their stamps are set per turn: current = 10, S = 2."""
    batch = run_episodes_async(StampingEngine(), Codec(), SleepyEnv, ROWS, SamplingConfig(n=2, max_new_tokens=3),
                               _limits(), step=3)
    current, s = 10, 2
    multi = [k for k, i in enumerate(batch.episode_info) if i["turns"] >= 2]
    old_first = multi[0]  # its first turn at current - S - 1, the later ones at current
    for k, mask in enumerate(batch.response_mask):
        versions = []
        for n, (start, end, is_model) in enumerate(_segments(mask)):
            v = (current - s - 1 if (k == old_first and n == 0) else current) if is_model else -100
            versions += [v] * (end - start)
        batch.versions[k] = versions
    split = split_over_stale(batch, current, s)
    assert split.resample == [batch.prompt_index[old_first]], split.resample
    assert split.stats.bound_violations == 0 and len(split.kept) == len(batch) - 2


# ---------------------------------------------------------------------------
# Episodes on engine servers (RemoteEpisodes over a RemoteEngines look-alike)
# ---------------------------------------------------------------------------

class FakeRemote:
    """``RemoteEngines``' submit / wait_any / collect, answering each one-sample request with
    ``_turn(step, key, budget)`` (the stand-ins' turn) stamped with ``version``."""

    logprobs_mode = "raw_logprobs"
    sampling = SamplingConfig(n=2, max_new_tokens=3)

    def __init__(self, fail_after: int | None = None):
        self.version, self.count, self.engines_used = 7, 2, []
        self.results, self._ids, self.fail_after = {}, itertools.count(), fail_after

    def submit(self, prompts, sampling=None, *, step, keys=None, budgets=None, engine=None):
        assert len(prompts) == 1 and sampling.n == 1
        ticket = next(self._ids)
        if self.fail_after is not None and ticket >= self.fail_after:
            raise RuntimeError("engine 1 (pid 42) died while generating step 3001")
        self.engines_used.append(engine % self.count)
        toks = _turn(step, keys[0], budgets[0])
        finish = "stop" if toks[-1] == Codec.eot_id else "length"
        self.results[ticket] = RolloutBatch([list(prompts[0])], [toks], [[-0.5] * len(toks)], [finish], [0],
                                            group_size=1, versions=[[self.version] * len(toks)])
        self.version += 1  # the weights move between turns
        return ticket

    def wait_any(self, tickets, timeout_s):
        return [t for t in tickets if t in self.results]

    def collect(self, ticket, timeout_s=None):
        return self.results.pop(ticket)


def test_async_remote_episodes_equal_the_inprocess_driver_and_raise_engine_errors():
    """Guards episodes played against the engine servers drawing other turns than the
    in-process driver (per-turn seed keys or step labels lost on the way), turns all sent to
    one engine, and an engine's death inside the episode thread swallowed (``collect``
    returning nothing, or hanging) instead of raised naming the engine, and episodes left
    running (submitting turns) after their caller gave up on them."""
    from grpo_mega.rollout.multi_turn_remote import RemoteEpisodes
    from grpo_mega.rollout.remote import RemoteEngineError

    s = SamplingConfig(n=2, max_new_tokens=3)
    want = run_episodes_async(StepEngine(), Codec(), SleepyEnv, ROWS, s, _limits(), step=3)
    remote = FakeRemote()
    episodes = RemoteEpisodes(remote, Codec(), SleepyEnv, _limits())
    got = episodes.collect(episodes.submit(ROWS, s, step=3), timeout_s=30)
    for field in ("prompt_ids", "response_ids", "response_mask", "logprobs", "prompt_index", "episode_rewards"):
        assert getattr(got, field) == getattr(want, field), field
    assert len(got.versions) == len(got) and set(remote.engines_used) == {0, 1}
    # Re-played groups keep their first seed keys: prompt 2's episodes, asked as key 2.
    again = episodes.collect(episodes.submit([ROWS[2]], s, step=3, keys=[2]), timeout_s=30)
    assert again.response_ids == want.response_ids[4:6] and again.prompt_index == [0, 0]
    dying = RemoteEpisodes(FakeRemote(fail_after=3), Codec(), SleepyEnv, _limits())
    with pytest.raises(RuntimeError, match="engine 1 .pid 42. died"):
        dying.collect(dying.submit(ROWS, s, step=3), timeout_s=30)
    # Engines that never answer: the caller's deadline ends the call naming the step, and the
    # episodes' thread stops instead of submitting turns behind the next step's back.
    mute = FakeRemote()
    mute.wait_any = lambda tickets, timeout_s: time.sleep(timeout_s) or []
    stuck = RemoteEpisodes(mute, Codec(), SleepyEnv, _limits())
    ticket = stuck.submit(ROWS, s, step=4)
    thread = stuck._jobs[ticket].thread
    with pytest.raises(RemoteEngineError, match="episodes of step 4 did not finish"):
        stuck.collect(ticket, timeout_s=0.2)
    thread.join(2.0)
    assert not thread.is_alive()


# ---------------------------------------------------------------------------
# DAPO under the pipeline: draws in data order, exactly once across a kill
# ---------------------------------------------------------------------------

class Cursor:
    """The data cursor: uids u0, u1, ... in order; its state is the position."""

    def __init__(self, pos: int = 0):
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos}

    def next_batch(self, k):
        out = [SimpleNamespace(uid=f"u{self.pos + i}") for i in range(k)]
        self.pos += k
        return out


class Engines:
    """Submit/collect whose samples carry the version at submission and the current one."""

    def __init__(self, version: int = 0, n: int = 2):
        self.version, self.sampling, self.submitted, self._t = version, SamplingConfig(n=n, seed=3), [], {}

    def submit(self, prompts, sampling=None, *, step, keys=None):
        ticket = len(self.submitted)
        self.submitted.append((step, (sampling or self.sampling).seed))
        self._t[ticket] = (len(prompts) if keys is None else len(keys), self.version)
        return ticket

    def collect(self, ticket, timeout_s=None):
        prompts, v = self._t.pop(ticket)
        n, rows = self.sampling.n, prompts * self.sampling.n
        return RolloutBatch([[1]] * rows, [[5, 6]] * rows, [[-0.1, -0.1]] * rows, ["stop"] * rows,
                            [i // n for i in range(rows)], group_size=n, versions=[[v, self.version]] * rows,
                            texts=[""] * rows, stop_reasons=[None] * rows)


def _trainer(tmp_path, s: int, pos: int = 0, version: int = 0):
    cfg = Config()
    cfg.rollout.placement, cfg.rollout.n, cfg.data.prompts_per_step = "separate", 2, 2
    cfg.algorithm.max_staleness, cfg.algorithm.dynamic_sampling = s, True
    cfg.logging.run_dir = str(tmp_path)
    return SimpleNamespace(cfg=cfg, engine=Engines(version), dataset=Cursor(pos), episodes=None, pipeline=None,
                           ps=SimpleNamespace(world_size=1, rank=0, dp_rank=0, dp=1))


ROUNDS = {1: 2, 2: 0, 3: 1, 4: 3, 5: 0, 6: 1, 7: 2, 8: 0}
"""DAPO rounds beyond the first each step needs (groups without a reward spread)."""


def _run(t, start: int, steps: int, s: int, stop_after: int | None = None):
    """The loop's order of calls: take (and DAPO rounds through ``stages.rollout``), sync,
    fill; a checkpoint after ``stop_after`` returns the data position it stores."""
    from grpo_mega.trainer import stages
    from grpo_mega.trainer.pipeline import RolloutPipeline

    t.pipeline = pipe = RolloutPipeline(s)
    pipe.fill(t, start + 1, steps)
    consumed = {}
    for step in range(start + 1, steps + 1):
        prompts, _, _ = pipe.take(t, step)
        uids = [p.uid for p in prompts]
        for r in range(1, ROUNDS[step] + 1):
            more, _ = stages.rollout(t, step, round=r)
            uids += [p.uid for p in more]
        assert pipe.metrics["staleness_bound_violations"] == 0
        consumed[step] = uids
        t.engine.version = step  # the sync that ends the step
        pipe.fill(t, step + 1, steps)
        if step == stop_after:
            return consumed, pipe.data_state(t)
    return consumed, None


@pytest.mark.parametrize("s", [0, 1, 2])
def test_async_dapo_rounds_draw_in_data_order_and_resume_exactly_once(tmp_path, s):
    """Guards DAPO under the asynchronous pipeline: extra rounds drawn straight from the data
    cursor after the draws already in flight (out of data order, so a checkpoint's position
    before the oldest draw in flight replays them after a kill: trained twice), or a draw
    label reused (its seeds repeat another draw's). The job is killed after step 4's
    checkpoint and resumed from its stored position: over the run every prompt is consumed
    exactly once, in the cursor's order, and no two draws share a step label and seed. At
    S = 0 the draws ask for the synchronous loop's seeds (round r of step k: step k, seed + r)."""
    steps, kill = 8, 4
    t = _trainer(tmp_path / "a", s)
    first, state = _run(t, 0, steps, s, stop_after=kill)
    labels = list(t.engine.submitted)
    t2 = _trainer(tmp_path / "b", s, pos=state["pos"], version=kill)
    second, _ = _run(t2, kill, steps, s)
    consumed = [u for k in range(1, steps + 1) for u in (first if k <= kill else second)[k]]
    assert consumed == [f"u{i}" for i in range(len(consumed))]  # in order, none twice, none skipped
    assert len(consumed) == 2 * sum(1 + ROUNDS[k] for k in range(1, steps + 1))
    for run in (labels, t2.engine.submitted):
        assert len(set(run)) == len(run), run
    if s == 0:
        want = [(k, 3 + r) for k in range(1, kill + 1) for r in range(ROUNDS[k] + 1)]
        assert labels == want + [(kill + 1, 3)]  # the last: step 5's, in flight at the kill


def test_async_multi_turn_and_dapo_pass_start_up_with_separate_engines():
    """Guards the refusals coming back: separate engines with S >= 1 must accept an
    environment (``env.name``, either ``env.scheduling``) and DAPO dynamic sampling."""
    from grpo_mega.preflight.validate import validate

    for scheduling in ("lockstep", "async"):
        flags = ["--rollout.placement=separate", "--algorithm.max_staleness=1", "--env.name=calculator",
                 f"--env.scheduling={scheduling}", "--algorithm.dynamic_sampling=true"]
        validate(load_config(None, flags), 2, check_hardware=False)
