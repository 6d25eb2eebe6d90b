"""Rollout engines in their own processes (``grpo_mega.rollout.remote``), real vLLM on CPU.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rollout/test_remote_engine.py

Layout, to keep the file fast: one pair of engine servers (``remote``) and one in-process
reference engine built fresh on weights B (``reference``) serve the whole module. Tests
say which weights the servers must hold (``hold``: pushes them when they differ) and run
in file order; the last ones kill the servers on purpose. Checkpoints A and B (and a
tokenizer) are built once in ``artifacts``; the weight-bridge test adds a megatron model
(TP=1) in this process.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_mega.rollout import EngineConfig, SamplingConfig
from grpo_mega.rollout.remote import wire
from tests.compare import assert_close

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")]
PROMPTS = ["What is 12 + 30?", "Compute 7 * 8.", "The quick brown fox", "a b c d", "Hello"]
MAX_LEN = 128
LONG = SamplingConfig(n=2, temperature=1.0, max_new_tokens=100, ignore_eos=True, seed=1)
"""Requests that run ~100 engine steps: long enough for an update to land mid-way."""


# ---------------------------------------------------------------------------
# Without vLLM: the wire
# ---------------------------------------------------------------------------

def test_async_bucket_round_trips_through_a_gloo_weights_group():
    """Guards the flat per-dtype packing: a tensor of one dtype landing in another's buffer,
    offsets shifted by a view's storage, or a non-contiguous source sent as its storage."""
    store = wire.store("127.0.0.1", 0, 2, 30, is_master=True)
    got = {}

    def peer():
        s = wire.store("127.0.0.1", store.port, 2, 30)
        pg = wire.weights_group(s, "127.0.0.1", 1, 2, "gloo", 30)
        flats = wire.empty_buffers(got["header"], torch.device("cpu"))
        for f in flats:
            wire.broadcast(pg, f)
        got["tensors"] = wire.unpack_bucket(got["header"], flats)

    base = torch.randn(6, 4)
    named = [("a.weight", base.t()), ("b.bias", torch.randn(5).bfloat16()), ("c.weight", base[2:4]),
             ("d.weight", torch.tensor([float("nan"), 1.0]))]
    got["header"] = json.loads(json.dumps(wire.bucket_header(named)))  # what the server reads
    t = threading.Thread(target=peer)
    t.start()
    pg = wire.weights_group(store, "127.0.0.1", 0, 2, "gloo", 30)
    header, flats = wire.pack_bucket(named, torch.device("cpu"))
    assert len(flats) == 2  # float32 and bfloat16: one broadcast each
    for f in flats:
        wire.broadcast(pg, f)
    t.join(30)
    assert [n for n, _ in got["tensors"]] == [n for n, _ in named]
    for (_, sent), (_, received) in zip(named, got["tensors"]):
        assert received.dtype == sent.dtype
        torch.testing.assert_close(received, sent, rtol=0, atol=0, equal_nan=True)


def test_async_control_messages_are_json_never_pickle():
    """Guards a control channel that unpickles what a peer sends (code execution for anyone
    who can connect): messages are JSON bytes, and a pickled object is refused."""
    import pickle
    from multiprocessing import Pipe

    a, b = Pipe()
    wire.send(a, {"op": "probe", "values": [1.5, float("nan")]})
    raw = b.recv_bytes()
    assert json.loads(raw)["values"][0] == 1.5
    a.send_bytes(pickle.dumps({"op": "x"}))
    with pytest.raises(UnicodeDecodeError):
        wire.recv(b)
    s = SamplingConfig(n=3, stop=("\n",), stop_token_ids=(2,), seed=4, temperature=0.7)
    assert wire.sampling_from_json(json.loads(json.dumps(wire.sampling_to_json(s)))) == s


# ---------------------------------------------------------------------------
# Shared engines
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    from grpo_mega.data.tokenizer import load_tokenizer
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("remote")
    tok = build_tiny_tokenizer(root / "tok", "qwen2")
    # init_std 0.2: peaked logits, so a uniform distribution's logprob stands out.
    art = {"tok": str(tok)}
    for name, seed in (("A", 0), ("B", 1)):
        art[name] = str(build_tiny_hf_checkpoint(root / name, "qwen2", tokenizer_dir=tok, seed=seed,
                                                 init_std=0.2))
    encode = load_tokenizer(str(tok)).encode
    art["prompts"] = [encode(t) for t in PROMPTS]
    art["vocab"] = json.loads((Path(art["A"]) / "config.json").read_text())["vocab_size"]
    return art


def _engine_config(model_dir: str, tok: str, **kw) -> EngineConfig:
    return EngineConfig(model_dir, tokenizer=tok, max_model_len=MAX_LEN, warmup=False,
                        logprobs_mode="processed_logprobs", **kw)


def weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def buckets(tensors: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """One bucket per decoder layer (whole fused layers), then the rest."""
    groups: dict[str, list] = {}
    for name, t in tensors.items():
        key = ".".join(name.split(".")[:3]) if ".layers." in name else "rest"
        groups.setdefault(key, []).append((name, t))
    return list(groups.values())


def push(remote, tensors: dict[str, torch.Tensor]) -> list[dict]:
    for bucket in buckets(tensors):
        remote.update_weights(bucket)
    return remote.commit()


@pytest.fixture(scope="module")
def remote(artifacts):
    from grpo_mega.rollout.remote import RemoteEngines

    engines = RemoteEngines(_engine_config(artifacts["A"], artifacts["tok"]), LONG, engines=2,
                            timeout_s=60, startup_timeout_s=300)
    engines.holding = "A"
    yield engines
    engines.close()


def hold(remote, artifacts, label: str) -> None:
    """Make the servers hold checkpoint ``label`` (a pushed update when they do not)."""
    if remote.holding != label:
        push(remote, weights(artifacts[label]))
        remote.holding = label


@pytest.fixture(scope="module")
def reference(artifacts):
    """A fresh in-process engine built on B: what the servers must equal once they hold B."""
    from grpo_mega.rollout import RolloutEngine

    eng = RolloutEngine(_engine_config(artifacts["B"], artifacts["tok"], mode="inprocess"), LONG)
    yield eng
    eng.shutdown()
    gc.collect()


def assert_same_samples(got, want) -> None:
    for field in ("prompt_ids", "response_ids", "finish_reasons", "prompt_index", "texts",
                  "stop_reasons", "group_size"):
        assert getattr(got, field) == getattr(want, field), field
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


SAMPLINGS = {
    "greedy": SamplingConfig(n=1, temperature=0.0, max_new_tokens=24),
    "seeded_t07_n3": SamplingConfig(n=3, temperature=0.7, max_new_tokens=16, seed=5),
    "seeded_topp_stop": SamplingConfig(n=2, temperature=1.0, top_p=0.9, max_new_tokens=20, seed=9,
                                       stop_token_ids=(5, 7)),
}


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_async_remote_samples_equal_the_inprocess_engine(remote, reference, artifacts, kind):
    """Guards the stepwise front end drawing other samples than ``RolloutEngine.generate``
    for the same seed (per-sample seeds not ``seed + j``, seeds following the engine split
    instead of the prompt's index, deltas mis-joined, results out of group-major order), and
    an update over the weights group that leaves the servers with other weights than a fresh
    engine built on them. Every token carries the committed version."""
    hold(remote, artifacts, "B")
    s = SAMPLINGS[kind]
    got = remote.generate(artifacts["prompts"], s, step=3)
    want = reference.generate(artifacts["prompts"], s, step=3)
    assert_same_samples(got, want)
    assert got.versions == [[remote.version] * len(r) for r in got.response_ids]
    assert len(got) == len(PROMPTS) * s.n


def _wait_for_tokens(remote, at_least: int, timeout_s: float = 60.0) -> None:
    """Until every engine has generated ``at_least`` more tokens (its counters, between steps)."""
    start = [e["tokens"] for e in remote.stats()["engines"]]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = [e["tokens"] for e in remote.stats()["engines"]]
        if all(b - a >= at_least for a, b in zip(start, now)):
            return
    raise AssertionError(f"engines made no progress in {timeout_s} s")


def _split_versions(versions: list[int], old: int, new: int) -> int:
    """Where a sample's versions switch from ``old`` to ``new`` (asserts the [old.., new..] form)."""
    k = versions.index(new) if new in versions else len(versions)
    assert versions == [old] * k + [new] * (len(versions) - k), versions
    return k


def _update_mid_flight(remote, prompts, step: int, prepare, update, attempts: int = 3):
    """Submit LONG requests, call ``update()`` (it pushes and commits, returning the engines'
    update reports) once every engine is a few tokens in, and collect: returns (the version
    before the update, the reports, the batch). ``prepare()`` sets up the weights first.

    Tried again when an engine had finished its share before the first bucket reached it (its
    report's ``in_flight`` is 0): on a loaded 2-core machine (CI) the test process can stall
    longer than the engines take for the ~100 steps left, and then no update can land mid-way.
    An engine that never reports a request in flight fails after ``attempts`` tries."""
    for _ in range(attempts):
        prepare()
        v = remote.version
        ticket = remote.submit(prompts, LONG, step=step)
        _wait_for_tokens(remote, at_least=4 * len(prompts))  # every sample a few tokens in
        reports = update()
        batch = remote.collect(ticket)
        if all(r["in_flight"] for r in reports):
            return v, reports, batch
    raise AssertionError(f"in {attempts} tries an engine had no request in flight when the "
                         f"update reached it: {reports}")


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_async_update_in_flight_tags_each_token_with_the_version_that_sampled_it(remote, artifacts, reference):
    """Guards the versions not advanced on an in-flight update, tokens tagged with another
    version than the weights that sampled them, requests dropped by the pause, and an
    engine left with wrong weights after an update pushed mid-generation.

    1. An update that zeroes the final norm (logits 0: every token then has logprob
       -log V exactly) lands while requests run: no token is sampled between its first
       bucket and its commit, each sample's versions are [v.., v+1..] with the switch
       mid-way, and exactly the tokens tagged v+1 have logprob -log V.
    2. B lands while requests run; later greedy samples equal a fresh engine built on B."""
    p = artifacts["prompts"]
    flat = {"model.norm.weight": torch.zeros_like(weights(artifacts["A"])["model.norm.weight"])}

    def zero_norm() -> list[dict]:
        remote.update_weights(list(flat.items()))
        remote.holding = "A+flat"  # from the first bucket on (a retry must push A again)
        # Paused from the first bucket to the commit: no token may be sampled from half-loaded
        # weights under the old version (the engines answer between steps even while paused).
        before = [e["tokens"] for e in remote.stats()["engines"]]
        time.sleep(0.3)
        assert [e["tokens"] for e in remote.stats()["engines"]] == before, "an engine stepped while paused"
        remote.update_weights([("model.norm.weight", flat["model.norm.weight"])])  # a second bucket
        return remote.commit()

    v, update, batch = _update_mid_flight(remote, p, 11, lambda: hold(remote, artifacts, "A"), zero_norm)
    assert remote.version == v + 1 and [u["version"] for u in update] == [v + 1, v + 1]
    assert all(u["in_flight"] == 1 and u["paused_s"] > 0 for u in update), update
    uniform = -math.log(artifacts["vocab"])
    assert len(batch) == len(p) * LONG.n
    for versions, lps, r in zip(batch.versions, batch.logprobs, batch.response_ids, strict=True):
        assert len(r) == LONG.max_new_tokens  # no request lost its tail to the pause
        k = _split_versions(versions, v, v + 1)
        assert 0 < k < len(versions), f"update did not land mid-way: switch at {k}"
        is_uniform = [abs(lp - uniform) < 1e-4 for lp in lps]
        assert is_uniform == [ver == v + 1 for ver in versions], (versions, lps)

    def push_b() -> list[dict]:
        remote.holding = "B"
        return push(remote, weights(artifacts["B"]))

    # A retry pushes B onto B: the versions still advance by one.
    u, _, batch = _update_mid_flight(remote, p, 12, lambda: None, push_b)
    for versions in batch.versions:
        k = _split_versions(versions, u, u + 1)
        assert 0 < k < len(versions)
    s = SAMPLINGS["greedy"]
    assert_same_samples(remote.generate(p, s, step=13), reference.generate(p, s, step=13))


class _ToolCodec:
    """Every turn is a tool call; the tool's reply is two fixed ids; row i's first prompt is
    prompt i's ids. Turns end at a stop id (half the vocabulary), so they are short."""

    eot_id = 0

    def __init__(self, prompts):
        self.prompts = prompts

    def first_ids(self, messages, tools):
        return list(self.prompts[int(messages[0]["content"])])

    def delta_ids(self, history, new, tools):
        return [3, 4]

    def parse(self, ids):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "t", "arguments": {}}}]}

    def check(self, *args):
        return []


class _SlowTool:
    """A tool that takes 50 ms; the sixth call ends the episode."""

    tools: list = []

    def reset(self, row):
        self.calls = 0
        return [{"role": "user", "content": str(row["i"])}]

    def step(self, message):
        from grpo_mega.envs.types import StepResult

        time.sleep(0.05)
        self.calls += 1
        return StepResult([{"role": "tool", "content": "r"}], reward=0.0, done=self.calls >= 6)

    def close(self):
        pass


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_async_multi_turn_episodes_span_an_update_with_each_turns_versions(remote, artifacts):
    """Guards multi-turn episodes on engine servers (asynchronous GRPO with ``env.name``)
    losing the versions of their turns across a weight update: each turn is its own request,
    and an update lands while the episodes run, so an episode must carry the old version on
    its early turns and the new one on its later turns, token by token, aligned with its
    response (the tool's tokens too), never going back to the old version."""
    from grpo_mega.rollout.multi_turn import EpisodeLimits
    from grpo_mega.rollout.multi_turn_remote import RemoteEpisodes

    s = SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=4,
                       stop_token_ids=tuple(range(2, artifacts["vocab"], 2)))
    limits = EpisodeLimits(max_turns=6, max_tokens=80, max_model_len=MAX_LEN, env_workers=4)
    rows = [{"i": i} for i in range(len(PROMPTS))]
    for _ in range(3):  # an update that lands after every episode ended proves nothing: again
        hold(remote, artifacts, "A")
        v = remote.version
        episodes = RemoteEpisodes(remote, _ToolCodec(artifacts["prompts"]), _SlowTool, limits)
        ticket = episodes.submit(rows, s, step=2)
        _wait_for_tokens(remote, at_least=2 * len(PROMPTS))
        remote.holding = "B"
        push(remote, weights(artifacts["B"]))
        batch = episodes.collect(ticket, timeout_s=120)
        spanned = 0
        for versions, ids, mask in zip(batch.versions, batch.response_ids, batch.response_mask, strict=True):
            assert len(versions) == len(ids) and set(versions) <= {v, v + 1}, versions
            assert versions == sorted(versions), versions  # never back to the old weights
            assert all(versions[t] == versions[t - 1] for t, m in enumerate(mask) if not m), (versions, mask)
            spanned += len({x for x, m in zip(versions, mask) if m}) == 2
        if spanned:
            break
    assert spanned, "no episode spanned the update in 3 tries"
    assert sorted(set(batch.prompt_index)) == list(range(len(PROMPTS))) and len(batch) == 2 * len(PROMPTS)


# ---------------------------------------------------------------------------
# The weight bridge through the proxy
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer(artifacts):
    """A megatron model (TP=1) loaded from A, in this process."""
    from grpo_mega.checkpoint import convert
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model

    ours = not torch.distributed.is_initialized()
    if ours:
        store = Path(artifacts["A"]).parent / "world_store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cfg = convert.read_model_config(artifacts["A"])
    ps = init_parallel(1, 1)
    model = build_model(cfg, ps)
    convert.load_hf_weights(model, artifacts["A"], ps, cfg)
    yield model, cfg, ps
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if ours:
        torch.distributed.destroy_process_group()


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_async_bridge_verification_checks_every_engine(remote, artifacts, trainer):
    """Guards a sync that one engine silently does not apply (a skipped bucket, a probe
    answered by another engine): ``WeightBridge.sync`` through the proxy gives both servers
    weights neither held before (the trainer's, after a step) and verifies every engine; the
    readings name their engine."""
    from grpo_mega.bridge import WeightBridge

    model, cfg, ps = trainer
    with torch.no_grad():  # new weights, as after an optimizer step
        for p in model.parameters():
            p.mul_(1.0 + 1e-2 * torch.rand_like(p))
    bridge = WeightBridge(model, cfg, ps, [remote], bucket_bytes=64 << 10)
    v = remote.version
    remote.holding = "trainer"
    stats = bridge.sync()  # raises WeightSyncError if an engine differs
    assert stats.buckets > 1 and stats.verified_tensors == stats.tensors
    assert remote.version == v + 1
    readings = remote.probe([("model.norm.weight", None, None)])
    assert sorted(r["probes"]["model.norm.weight"][0]["via"] for r in readings) == ["engine 0", "engine 1"]


# ---------------------------------------------------------------------------
# Liveness (these break the shared engines: keep them last)
# ---------------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_async_hung_engine_fails_the_call_naming_it(remote):
    """Guards a controller call that waits forever on an engine that stopped answering."""
    from grpo_mega.rollout.remote import RemoteEngineError

    e1 = remote.engines[1]
    os.kill(e1.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteEngineError, match=rf"engine 1 \(pid {e1.pid}\) gave no answer within "
                                                    r"3 s while probing its weights"):
            remote.probe([("model.norm.weight", None, None)], timeout_s=3)
        assert time.monotonic() - start < 10
    finally:
        os.kill(e1.pid, signal.SIGCONT)
    assert remote.stats()["engines"][1]["pid"] == e1.pid  # answers again once resumed


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_async_killed_engine_fails_the_next_call_naming_it(remote, artifacts):
    """Guards a trainer that waits (until a long timeout, or forever) for samples from an
    engine that died: the call fails at once, naming the engine, its pid, what it was
    doing and how it died."""
    from grpo_mega.rollout.remote import RemoteEngineError

    ticket = remote.submit(artifacts["prompts"], LONG, step=7)
    e1 = remote.engines[1]
    os.kill(e1.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RemoteEngineError, match=rf"engine 1 \(pid {e1.pid}\) died while generating "
                                                r"step 7: exit code -9"):
        remote.collect(ticket, timeout_s=50)
    assert time.monotonic() - start < 10


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_async_server_exits_when_the_controller_connection_drops(remote):
    """Guards an engine server that outlives its controller (the OS closes a dead
    controller's sockets; the server must see EOF between steps and exit)."""
    e0 = remote.engines[0]
    sock = socket.socket(fileno=os.dup(e0.conn.fileno()))
    sock.shutdown(socket.SHUT_RDWR)  # what the controller's death does to the connection
    sock.close()
    assert e0.proc.wait(timeout=15) == 0


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_async_server_stops_when_the_controller_process_dies(artifacts, tmp_path):
    """Guards an engine server left running (holding its device and cores) after its
    controller was SIGKILLed while the server was still starting its engine: the lifeline
    stops it within seconds. The connection alone would tell it only once vLLM is up, so the
    server is held at ``remote.start`` (config received, engine not built, no message read)
    and the controller is killed only once the server says it is there: the kill lands in
    the start-up window every time, however fast the machine."""
    import psutil

    script = ("from grpo_mega.rollout import EngineConfig\n"
              "from grpo_mega.rollout.remote import RemoteEngines\n"
              f"RemoteEngines(EngineConfig({artifacts['A']!r}, max_model_len={MAX_LEN}), engines=1)\n")
    log = tmp_path / "controller.log"
    env = dict(os.environ, GRPO_MEGA_FAULT="remote.start:hold")
    with open(log, "w") as out:
        ctl = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=out,
                               stderr=subprocess.STDOUT)
    servers = []
    try:
        deadline = time.monotonic() + 90
        while "fault injected: hold at remote.start" not in log.read_text():
            assert ctl.poll() is None, f"the controller exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no server reached remote.start:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        servers = [c for c in psutil.Process(ctl.pid).children()
                   if "grpo_mega.rollout.remote.server" in " ".join(c.cmdline())]
        assert servers, "the controller spawned no server"
    finally:
        ctl.kill()
        ctl.wait()
    gone, alive = psutil.wait_procs(servers, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, "engine server outlived its controller"
    assert "is gone; stopping" in log.read_text(), "the server stopped, but not by its lifeline"
