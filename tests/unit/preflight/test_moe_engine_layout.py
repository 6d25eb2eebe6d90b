"""Start-up checks of where an MoE model's rollout engines may run (``preflight.validate``)."""
from __future__ import annotations

import pytest
import torch

from grpo_mega.config import ConfigError, load_config
from grpo_mega.preflight.validate import validate

MOE = ["--model.family=qwen3_moe", "--model.num_experts=4", "--model.moe_ffn_hidden_size=16",
       "--parallel.ep=2", "--data.prompts_per_step=4"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the limit is vLLM's CPU build")
def test_moe_engine_replicas_side_by_side_are_refused_on_cpu():
    """Guards against an MoE run with several vLLM engine replicas on CPU starting, building
    both models and then dying in the engine's first forward with a bare NotImplementedError
    (vLLM's data-parallel MoE dispatch calls all_gatherv, which its CPU communicator lacks).
    The error names the layout and the flag that fixes it; one replica over the world passes,
    and a dense model keeps its replicas."""
    with pytest.raises(ConfigError, match=r"--rollout\.tp=2"):
        validate(load_config(None, [*MOE, "--rollout.tp=1"]), 2)
    validate(load_config(None, [*MOE, "--rollout.tp=2"]), 2)
    validate(load_config(None, ["--rollout.tp=1", "--data.prompts_per_step=4"]), 2)
