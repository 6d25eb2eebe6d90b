"""The old-policy (proximal) pass of ``stages.logprobs`` under each off-policy objective and
staleness bound, on a real tiny model (one rank): which configurations run it, that its
log-probs land in the batch, and that the update then trains against them.

One launch runs every configuration (each launch costs the megatron imports)."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.unit.trainer.test_batch import _batch, _model_cfg

CASES = {  # name -> (off_policy, max_staleness, tis_cap, ppo_epochs, proximal pass expected)
    "sync": ("decoupled", 0, None, 1, False),
    "sync_tis": ("decoupled", 0, 2.0, 1, False),  # one optimizer step: the update's log-probs are proximal
    "stale": ("decoupled", 1, None, 1, False),    # the same, for stale samples (issue 40 finding 5)
    "stale_epochs": ("decoupled", 1, None, 2, True),
    "behaviour": ("behaviour", 2, None, 2, False),
}


def _stages_rank(rank, world):
    from grpo_mega.config import Config, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer import stages
    from grpo_mega.trainer.passes import compute_logprobs
    from grpo_mega.trainer.trainer import Trainer

    ps = init_parallel(1, 1, seed=5)
    cfg = Config()
    cfg.model = _model_cfg()
    cfg.rollout.n, cfg.data.prompts_per_step, cfg.parallel.micro_batch_size = 2, 3, 3  # one mini-batch of 6
    cfg.algorithm.kl_coef = 0.0
    model = build_model(cfg.model, ps)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-3), ps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.opt, lambda s: 1.0)
    t = Trainer(cfg=cfg, ps=ps, model=model, ref=None, optimizer=opt, scheduler=sched, tokenizer=None,
                dataset=None, eval_set=None, engine=None, bridge=None, scorer=None, sink=None, ckpt_dir=None)
    # the current policy's log-probs of the batch, computed directly
    want = _batch()
    want.old_logp = want.empty_logp()
    compute_logprobs(model, want.split(3), ps, vocab_size=cfg.model.vocab_size, temperature=t.temperature,
                     key="old_logp")
    out = {}
    for name, (off_policy, s, cap, epochs, _) in CASES.items():
        cfg.algorithm.off_policy, cfg.algorithm.max_staleness, cfg.algorithm.tis_cap = off_policy, s, cap
        cfg.algorithm.ppo_epochs = epochs
        b = _batch()
        plan = stages.logprobs(t, b)
        out[name] = {"pass": plan.off_policy, "filled": b.old_logp is not None,
                     "one_mini": len(plan.minis) == 1}
        if b.old_logp is not None:
            m = b.loss_mask
            out[name]["diff"] = float((b.old_logp - want.old_logp)[m].abs().max())
            out[name]["zero_off_mask"] = bool((b.old_logp[~m] == 0).all())
            # the micro-batches are views of the batch: the update reads these log-probs
            out[name]["views"] = all(mb.old_logp.untyped_storage().data_ptr() == b.old_logp.untyped_storage().data_ptr()
                                     for mb in plan.flat)
    return out


@pytest.mark.slow
def test_off_policy_proximal_pass_runs_only_when_the_policy_moves():
    """Guards against the trainer running the proximal pass where it cannot change the loss
    (issue 40 finding 5: one epoch and one mini-batch, with stale samples or a cap too; the
    update's own log-probs, detached, are the proximal ones), against skipping it when the
    policy moves within the step (two PPO epochs: the update would clip against moving
    weights), against running it under ``behaviour`` (a wasted forward), and against the
    pass's log-probs not reaching the batch the update reads."""
    (r,) = run_ranks(1, _stages_rank, timeout=300)
    for name, (*_, expected) in CASES.items():
        got = r[name]
        assert got["one_mini"], (name, got)
        assert got["pass"] is expected and got["filled"] is expected, (name, got)
        if expected:
            assert got["diff"] <= 1e-6 and got["zero_off_mask"] and got["views"], (name, got)
