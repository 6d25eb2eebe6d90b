"""SMOKE JOB (not GRPO): a few forward/backward/optimizer steps of a tiny megatron model.

Checks that a launch layout works end to end (process groups, TP/PP model,
pipeline schedule, gradient reduction, clipping) without vLLM. Used by the
launch scripts' tests and as a quick health check on a new cluster:

    torchrun --nproc-per-node 2 -m grpo_mega.testing.smoke --parallel.tp=2
"""
from __future__ import annotations

import os
import sys
import time

import torch


def main(argv=None) -> int:
    from grpo_mega.config import cli_config
    from grpo_mega.preflight.validate import validate
    from grpo_mega.models import build_model, mask_vocab_padding
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.distributed.state import destroy_parallel, init_parallel
    from grpo_mega.distributed.schedule import run_microbatches
    from grpo_mega.algorithms import vocab_parallel_logprobs

    cfg = cli_config(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world)
    ps = init_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.parallel.seed,
                       timeout_minutes=cfg.parallel.timeout_minutes)
    m = cfg.model
    model = build_model(m, ps)
    opt = ParallelAdamW(model, cfg.optimizer, ps)
    g = torch.Generator().manual_seed(cfg.parallel.seed + ps.dp_rank)
    mbs, seq = cfg.parallel.micro_batch_size, 16
    for step in range(3):
        t0 = time.time()
        micro = [{"tokens": torch.randint(0, m.vocab_size, (mbs, seq), generator=g)} for _ in range(2)]
        total = float(2 * mbs * (seq - 1) * ps.dp)

        def loss_fn(logits, mb):
            logits = mask_vocab_padding(logits, m.vocab_size, ps.tp_rank)
            lp = vocab_parallel_logprobs(logits[:, :-1].float(), mb["tokens"][:, 1:].to(ps.device),
                                         ps.tp_group)
            return -lp.sum() / total, {"nll": -lp.detach().sum()}

        opt.zero_grad()
        outs = run_microbatches(model, micro, loss_fn, ps, forward_only=False)
        info = opt.step()
        if ps.is_last_stage and ps.tp_rank == 0 and ps.dp_rank == 0:
            nll = float(sum(o["nll"] for o in outs)) / (total / ps.dp)
            print(f"[smoke] step {step} nll/token {nll:.4f} grad_norm {info['grad_norm']:.4f} "
                  f"({time.time() - t0:.2f}s) {ps.describe()}", flush=True)
    if ps.rank == 0:
        print(f"[smoke] OK: world {ps.world_size} tp {ps.tp} pp {ps.pp} dp {ps.dp}", flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
