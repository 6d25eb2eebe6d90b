"""``optimizer.distributed_impl``: which ZeRO-1 implementation ``use_distributed_optimizer``
builds, checked at start-up (CPU). The megatron path itself is tested, GPU-marked, in
tests/unit/optim/test_megatron_optimizer.py."""
from __future__ import annotations

import pytest
import torch

from grpo_mega.config import ConfigError, load_config
from grpo_mega.preflight.validate import validate

ON = "--optimizer.use_distributed_optimizer=true"


@pytest.mark.parametrize("overrides, needle", [
    ([ON, "--optimizer.distributed_impl=apex"], r"optimizer.distributed_impl='apex' is not one of"),
    (["--optimizer.distributed_impl=megatron"], r"use_distributed_optimizer=false; set "
                                                 r"--optimizer.use_distributed_optimizer=true"),
])
def test_distributed_optimizer_impl_errors_name_the_flag(overrides, needle):
    """Guards against an unknown implementation name reaching build_optimizer (which would
    silently build the project's optimizer), and against ``distributed_impl=megatron``
    with the sharded optimizer off being accepted and then ignored."""
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(None, overrides), 1, check_hardware=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_distributed_optimizer_megatron_impl_refused_without_cuda_at_start_up():
    """Guards against a megatron-optimizer job starting on a machine without CUDA and dying
    inside megatron's DDP allocation (after the models are built); ``--check-config``
    (hardware probes off) still accepts it, so a GPU job can be checked from a login node."""
    cfg = load_config(None, [ON, "--optimizer.distributed_impl=megatron"])
    with pytest.raises(ConfigError, match=r"distributed_impl=megatron needs a CUDA GPU.*"
                                          r"--optimizer.distributed_impl=grpo"):
        validate(cfg, 1)
    validate(cfg, 1, check_hardware=False)
    validate(load_config(None, [ON]), 1)  # the default impl (grpo) runs here

    from grpo_mega.optim import build_optimizer
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        build_optimizer(torch.nn.Linear(2, 2), cfg.optimizer, None)
