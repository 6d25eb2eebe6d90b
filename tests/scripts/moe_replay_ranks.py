"""One 2-rank gloo launch for MoE routing replay (tests/unit/trainer/test_moe_routing_replay.py).

A tiny Qwen3-MoE (4 experts, top-2, 2 layers) written by transformers is loaded at each
(tp, pp, ep) of LAYOUTS and runs the trainer's real ``stages.logprobs`` and
``stages.update`` on a fixed global batch of 8 sequences of mixed lengths, in two
mini-batches (so the old-policy pass runs, and mini-batch 2's update forward sees weights
that one optimizer step has changed), twice: ``algorithm.routing_replay`` off and
``record-in-trainer``. A forward hook on every megatron ``Router`` observes, independently
of ``grpo_mega.models.routing``, which experts each forward actually used (the routing
map's True columns, rows in the router's sequence-major order). Each rank reports, per
mode, the observed routing of each pass per micro-batch, the recorded
``batch.routed_experts``, and the update's mean |logp - old_logp| on mini-batch 2 (the
batch's rollout log-probs are set to the old-policy ones, so ``rollout_logp_gap`` measures it).
At EP2, ``record-in-trainer`` also runs with ``parallel.packing`` and a token budget
(``parallel.max_tokens_per_micro_batch``, key suffix `` packed``): its observed routing is in
packed order (``[1, T, k]`` per micro-batch), and it reports each micro-batch's packed-to-grid
index (grid rows in the step's order, before the budget's reordering).
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1)]  # (tp, pp, ep) at world 2
PACKED = (1, 1, 2)  # also run packed (parallel.packing), record-in-trainer, at EP2
BUDGET = 19  # ... under this token budget: mini-batch 1 fits one micro-batch on rank 0 (5 + 11
# tokens) and needs two on rank 1 (11 + 10): the count must be agreed, or the all-to-alls part;
# mini-batch 2 is one packed micro-batch of two rows on both (10 + 9, 9 + 8)
GLOBAL, MINI, MICRO = 8, 4, 2
LR = 3e-3  # large, so that one step flips some tokens' experts


def global_batch_lists(vocab: int):
    g = torch.Generator().manual_seed(17)
    prompts, responses, adv = [], [], []
    for i in range(GLOBAL):
        p, r = 3 + i % 4, 2 + (5 * i) % 7
        prompts.append(torch.randint(3, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(3, vocab, (r,), generator=g).tolist())
        adv.append(1.0 if i % 3 else -1.0)
    return prompts, responses, adv


def _observe(model, log: list):
    """Hooks appending (global layer, [rows, k] sorted expert ids) per router call."""
    from grpo_mega.models.routing import routers

    def hook(layer, _mod, _inp, out):
        routing_map = out[1]
        k = int(routing_map.sum(1).max())
        ids = torch.nonzero(routing_map)[:, 1].reshape(-1, k)  # row-major: sorted per row
        log.append((layer, ids.clone()))
    return [r.register_forward_hook(lambda m, i, o, layer=layer: hook(layer, m, i, o))
            for layer, r in routers(model)]


def _per_micro(log: list, shapes: list[tuple[int, int]]) -> list[dict]:
    """Split a pass's hook log into micro-batches: {layer: [b, s, k]} each."""
    from collections import defaultdict
    by_layer = defaultdict(list)
    for layer, ids in log:
        by_layer[layer].append(ids)
    out = []
    for j, (b, s) in enumerate(shapes):
        out.append({layer: calls[j].reshape(s, b, -1).transpose(0, 1).contiguous()
                    for layer, calls in by_layer.items()})
    return out


def _run(root: Path, tp: int, pp: int, ep: int, mode: str, packing: bool = False, budget: int = 0) -> dict:
    from megatron.core import parallel_state as mpu

    from grpo_mega.checkpoint.convert import load_hf_weights
    from grpo_mega.config import load_config
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models.gpt import build_model
    from grpo_mega.models.hf_config import model_config_from_hf
    from grpo_mega.models.routing import install_router_replay
    from grpo_mega.optim import build_optimizer
    from grpo_mega.trainer import stages
    from grpo_mega.trainer.batch import TrainingBatch

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    ps = init_parallel(tp, pp, ep=ep, seed=3)
    cfg = load_config(None, [f"--algorithm.routing_replay={mode}", "--algorithm.kl_coef=0",
                             f"--data.prompts_per_step={GLOBAL}", "--rollout.n=1",
                             f"--data.mini_batch_size={MINI}", f"--parallel.micro_batch_size={MICRO}",
                             f"--optimizer.lr={LR}", f"--parallel.packing={str(packing).lower()}",
                             f"--parallel.max_tokens_per_micro_batch={budget}"])
    cfg.model = model_config_from_hf(json.loads((root / "hf" / "config.json").read_text()))
    model = build_model(cfg.model, ps)
    load_hf_weights(model, root / "hf", ps, cfg.model)
    if mode != "off":
        install_router_replay(model)
    opt = build_optimizer(model, cfg.optimizer, ps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.opt, lambda s: 1.0)
    t = SimpleNamespace(cfg=cfg, ps=ps, model=model, ref=None, temperature=1.0, optimizer=opt, scheduler=sched)

    prompts, responses, adv = global_batch_lists(cfg.model.vocab_size)
    rows = slice(ps.dp_rank * GLOBAL // ps.dp, (ps.dp_rank + 1) * GLOBAL // ps.dp)
    batch = TrainingBatch.pack(prompts[rows], responses[rows], [[0.0] * len(r) for r in responses[rows]],
                               adv[rows], pad_id=0, packing=cfg.parallel.packing)
    log: list = []
    handles = _observe(model, log)
    batch.ref_logp = batch.empty_logp()  # unused by the loss (kl_coef 0): the gap's reference
    plan = stages.logprobs(t, batch)
    batch, order = plan.batch, plan.order  # rows reordered under a token budget
    back = torch.argsort(torch.tensor(order))
    shapes = [tuple((mb.packed if mb.packing else mb).tokens.shape) for mb in plan.flat]
    old_seen = _per_micro(log, shapes)
    log.clear()
    if ps.is_last_stage:
        batch.rollout_logp.copy_(batch.old_logp)  # rollout_logp_gap then measures |logp - old_logp|
    _reference_after_first_step(t, plan, log)
    metrics = stages.update(t, plan)
    update_seen = _per_micro(log, shapes)
    ref_sum, ref_n = 0.0, 0.0
    if ps.is_last_stage and ps.tp_rank == 0:  # TP ranks hold the same log-probs
        for mb in plan.minis[1]:
            m = mb.loss_mask.double()
            ref_sum += float(((mb.ref_logp.double() - mb.old_logp.double()).abs() * m).sum())
            ref_n += float(m.sum())
    for h in handles:
        h.remove()
    return {"dp_rank": ps.dp_rank, "dp": ps.dp, "pp_rank": ps.pp_rank, "shapes": shapes,
            "micro_rows": [(mb_start, len(mb)) for mb_start, mb in _row_starts(plan)],
            "old_seen": old_seen, "update_seen": update_seen,
            "routed": None if batch.routed_experts is None else batch.routed_experts[back].clone(),
            "replayed_flag": plan.replay_routing, "gap_mb2": float(metrics.get("rollout_logp_gap", 0.0)),
            "is_last_stage": ps.is_last_stage, "ref_gap_sum": ref_sum, "ref_gap_tokens": ref_n,
            "packed_index": [(torch.tensor(order)[mb.packed.rows + start], mb.packed.cols)
                             for start, mb in _row_starts(plan) if mb.packing],
            "micro_batches": len(plan.flat)}


FP64_BUDGET = 21  # tokens: two packed micro-batches of two rows on each rank (11 + 5 | 10 + 9, 11 + 8 | 10 + 9)


class _Grads:
    """The optimizer ``update_policy`` steps: keeps each parameter's gradient, moves nothing."""

    def __init__(self, model):
        self.params = list(model.parameters())

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]
        return {"grad_norm": 0.0, "skipped": False}


def _packed_fp64(root: Path) -> dict:
    """EP2 in float64 without the load-balancing loss (it is taken per micro-batch, over the
    positions a pass computes, so it depends on the grouping by design): this rank's rows,
    old-policy log-probs and one update (no optimizer step; each rank's local gradients,
    experts' included, which hold both ranks' tokens) padded in micro-batches of ``MICRO``
    rows and packed under ``FP64_BUDGET`` tokens; log-probs in row order."""
    import dataclasses

    from megatron.core import parallel_state as mpu

    from grpo_mega.checkpoint.convert import load_hf_weights
    from grpo_mega.config import AlgorithmConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models.gpt import build_model
    from grpo_mega.models.hf_config import model_config_from_hf
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    ps = init_parallel(1, 1, ep=2, seed=3)
    m = dataclasses.replace(model_config_from_hf(json.loads((root / "hf" / "config.json").read_text())),
                            moe_aux_loss_coeff=0.0)
    model = build_model(m, ps)
    load_hf_weights(model, root / "hf", ps, m)
    model = model.double()
    model.config.moe_router_dtype = "fp64"  # the trainer routes in fp32; fp32 logits would round by grouping
    prompts, responses, adv = global_batch_lists(m.vocab_size)
    rows = slice(ps.dp_rank * GLOBAL // ps.dp, (ps.dp_rank + 1) * GLOBAL // ps.dp)
    kw = dict(vocab_size=m.vocab_size, temperature=1.0)
    algo = AlgorithmConfig(kl_coef=0.0, clip_low=0.2, clip_high=0.28)
    out = {}
    for name, packing, budget in (("padded", False, 0), ("packed", True, FP64_BUDGET)):
        b = TrainingBatch.pack(prompts[rows], responses[rows], [[-1.0] * len(r) for r in responses[rows]],
                               adv[rows], pad_id=0, packing=packing)
        b, sizes, order = plan_micro_batches(b, len(b), MICRO, budget, ps.dp_group, ps.device)
        back = torch.argsort(torch.tensor(order))
        b.old_logp = torch.zeros(b.loss_mask.shape, dtype=torch.float64)
        compute_logprobs(model, cut(b, sizes)[0], ps, key="old_logp", **kw)
        logp, mask = b.old_logp[back].clone(), b.loss_mask[back]
        g = torch.Generator().manual_seed(5)  # an old policy some way off, drawn in row order
        b.old_logp = (logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64) * mask)[order]
        opt = _Grads(model)
        update_policy(model, opt, cut(b, sizes)[0], ps, algo, max_len=8, reuse_current_as_old=False, **kw)
        out[name] = dict(logp=logp, mask=mask, grads=opt.grads, micro_batches=len(sizes[0]))
    pd, pk = out["padded"], out["packed"]
    from tests.compare import max_abs_diff, max_abs_diff_all, worst
    return {"logp_diff": max_abs_diff(pk["logp"][pd["mask"]], pd["logp"][pd["mask"]]),
            "logp_scale": float(pd["logp"][pd["mask"]].abs().max()),
            "grad_diff": max_abs_diff_all(pk["grads"], pd["grads"]),
            "grad_scale": worst(float(x.abs().max()) for x in pd["grads"]),
            "micro_batches": (pd["micro_batches"], pk["micro_batches"])}


def _reference_after_first_step(t, plan, log: list) -> None:
    """The gap's independent reference: right after mini-batch 1's optimizer step, a
    forward-only pass over mini-batch 2 (routing replayed when the update replays it)
    writes its log-probs into ``mb.ref_logp``; the test takes mean |ref_logp - old_logp|
    over mini-batch 2's response tokens in fp64 itself. The router hooks' entries of this
    extra pass are dropped, so the observed update passes stay the update's own."""
    from grpo_mega.models import routing as R
    from grpo_mega.trainer.passes import compute_logprobs

    opt, step, calls = t.optimizer, t.optimizer.step, []

    def step_then_measure(*a, **kw):
        info = step(*a, **kw)
        calls.append(1)
        if len(calls) == 1:
            mark = len(log)
            with torch.no_grad():
                for mb in plan.minis[1]:
                    ctx = (R.replaying(t.model, mb.routed_experts, mb.packed) if plan.replay_routing
                           else contextlib.nullcontext())
                    with ctx:
                        compute_logprobs(t.model, [mb], t.ps, vocab_size=t.cfg.model.vocab_size,
                                         temperature=1.0, key="ref_logp")
            del log[mark:]
        return info

    opt.step = step_then_measure


def _row_starts(plan):
    start = 0
    for mb in plan.flat:
        yield start, mb
        start += len(mb)


def _rank_main(rank: int, world: int, root: str) -> dict:
    from tests.scripts.bridge_fixtures import write_hf_checkpoint

    root = Path(root)
    if rank == 0:
        write_hf_checkpoint(root / "hf", "qwen3_moe", tie=False, seed=5, hidden_size=64,
                            max_position_embeddings=64)
    torch.distributed.barrier()
    runs = {f"tp{tp} pp{pp} ep{ep} {mode}": _run(root, tp, pp, ep, mode)
            for tp, pp, ep in LAYOUTS for mode in ("off", "record-in-trainer")}
    tp, pp, ep = PACKED
    runs[f"tp{tp} pp{pp} ep{ep} record-in-trainer packed"] = _run(root, tp, pp, ep, "record-in-trainer", True,
                                                                  budget=BUDGET)
    runs["fp64 ep2 packed"] = _packed_fp64(root)
    return runs


def launch() -> list[dict]:
    from tests.distributed import run_ranks

    with tempfile.TemporaryDirectory(prefix="moe_replay_") as root:
        return run_ranks(2, _rank_main, root, timeout=900)
