"""The output layer only at trainable positions (``models.head``): log-probs, the exact KL
and gradients equal the path that scores every position, and no prompt or tool position
ever reaches the output layer.

Everything runs in float64 (the models cast with ``.double()``), so both paths agree to
rounding. The batch has non-contiguous loss masks (model tokens, then tool tokens, then
model tokens again), one response cut to nothing and one micro-batch with no trainable
token at all. Layouts: TP=2 (the policy, and the frozen reference of ``kl_kind: full``);
megatron's output layer built for sequence parallelism at TP=2, fed hidden states split
along the sequence (the whole model cannot run SP on a CPU: megatron's torch norms refuse
it, see docs/guides/memory.md); and PP=2. The 2 ranks are the launch of
``test_full_kl.py``, which runs first (each launch costs 10-20 s of imports).
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.compare import max_abs_diff, max_abs_diff_all, worst
from tests.distributed import run_ranks
from tests.unit.trainer.test_batch import _batch, _model_cfg

VOCAB, TEMP, CHUNK = 50, 0.7, 3
LAYOUTS = ("tp2", "pp2")


def _episodes():
    """``test_batch``'s rows with tool output inside responses: rows 1 and 5 have masked
    holes (model, tool, model); rows 2 and 3 train on nothing, so the second micro-batch of
    two rows has K = 0."""
    b = _batch()
    g = torch.Generator().manual_seed(4)
    b.loss_mask[1, 1:3] = False   # row 1: prompt [8], response 22 | 23 24 (tool) | 25 26
    b.loss_mask[5, 2] = False     # row 5: response 33 | 34 (tool) | 35 36
    b.loss_mask[2:4] = False
    b.rollout_logp = torch.where(b.loss_mask, b.rollout_logp, torch.zeros_like(b.rollout_logp))
    b.advantages = torch.randn(len(b), generator=g, dtype=torch.float64).float()
    return b


class _Grads:
    """The optimizer ``update_policy`` steps: keeps each parameter's gradient, moves nothing."""

    def __init__(self, model):
        self.params = list(model.parameters())

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [p.grad.clone() for p in self.params]
        return {"grad_norm": 0.0, "skipped": False}


def _rows_reaching_output_layer(model, log):
    """A forward hook counting the rows of every output-layer call of ``model`` (none on a
    stage without one)."""
    from grpo_mega.models import unwrap_model

    layer = getattr(unwrap_model(model), "output_layer", None)
    if layer is None or not unwrap_model(model).post_process:
        return None
    return layer.register_forward_hook(lambda mod, args, out: log.append(out[0].shape[0] * out[0].shape[1]))


def policy_and_reference(ps):
    """A float64 policy and a frozen reference some way off it, the same on every rank."""
    from grpo_mega.models import build_model

    torch.manual_seed(21)
    model = build_model(_model_cfg(), ps).double()
    ref = build_model(_model_cfg(), ps, frozen=True).double()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(7)  # same noise on every rank: replicated weights stay equal
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters(), key=lambda kv: kv[0]):
            p.add_(p.abs().mean().clamp(min=0.02) * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model, ref


def _paths(ps) -> dict:
    """Old-policy log-probs and one ``kl_kind: full`` update, at every position and at the
    trainable ones only; rows counted at the output layers of the policy and the reference."""
    from grpo_mega.config import AlgorithmConfig
    from grpo_mega.trainer.passes import compute_logprobs, metrics_to_floats, update_policy

    model, ref = policy_and_reference(ps)
    algo = AlgorithmConfig(kl_coef=0.5, kl_kind="full", clip_low=0.2, clip_high=0.28)
    kw = dict(vocab_size=VOCAB, temperature=TEMP, chunk_size=CHUNK)
    out = {}
    for lean in (True, False):
        path = {} if lean else {"all_positions": True}  # the lean run takes the defaults
        b = _episodes()
        b.old_logp = b.empty_logp()
        rows, logs = [], [[], []]
        hooks = [h for h in (_rows_reaching_output_layer(model, logs[0]),
                             _rows_reaching_output_layer(ref, logs[1])) if h is not None]
        compute_logprobs(model, b.split(2), ps, key="old_logp", **path, **kw)
        old = b.old_logp.clone()
        rows.append(list(logs[0]))
        logs[0].clear()
        # an old policy some way off, so the clip and the ratio's gradient both act
        b.old_logp = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9)) * b.loss_mask
        opt = _Grads(model)
        metrics = metrics_to_floats(update_policy(model, opt, b.split(2), ps, algo, max_len=8,
                                                  reuse_current_as_old=False, reference=ref,
                                                  **path, **kw))
        rows += [list(logs[0]), list(logs[1])]
        for h in hooks:
            h.remove()
        out["lean" if lean else "all"] = dict(old=old, metrics=metrics, grads=opt.grads, rows=rows)
    b = _episodes()
    lean, full = out["lean"], out["all"]
    mask = b.loss_mask
    res = {"stage_has_head": ps.is_last_stage}
    if ps.is_last_stage:
        res["logp_diff"] = max_abs_diff(lean["old"][mask], full["old"][mask])
        res["logp_scale"] = float(full["old"][mask].abs().max())
        res["logp_zero_elsewhere"] = bool((lean["old"][~mask] == 0).all())
        res["metrics_diff"] = {k: abs(lean["metrics"][k] - v) / max(abs(v), 1e-12)
                               for k, v in full["metrics"].items()}
        res["kl"] = full["metrics"]["kl"]
        res["clipfrac"] = full["metrics"]["clipfrac_high"] + full["metrics"]["clipfrac_low"]
        # per micro-batch: trainable tokens, and all positions [b, s] of the trimmed slice
        micro = b.split(2)
        res["want_rows"] = [int(m.loss_mask.sum()) for m in micro]
        res["all_rows"] = [m.tokens.numel() for m in micro]
        res["rows"], res["rows_all"] = lean["rows"], full["rows"]
    res["grad_diff"] = max_abs_diff_all(lean["grads"], full["grads"])
    res["grad_scale"] = worst(float(x.abs().max()) for x in full["grads"])
    return res


def _sequence_parallel(ps) -> dict:
    """Megatron's output layer built with ``sequence_parallel`` at TP=2, hidden states split
    along the sequence: log-probs at the trainable positions and the gradients of the
    hidden-state shard and the weight shard, new path against the layer's own SP gather."""
    import dataclasses

    from megatron.core.tensor_parallel import ColumnParallelLinear

    from grpo_mega import algorithms as A
    from grpo_mega.models import padded_vocab_size, transformer_config
    from grpo_mega.models.head import trainable_logits

    m = dataclasses.replace(_model_cfg(), sequence_parallel=True)
    cfg = transformer_config(m, ps, use_te=False)
    torch.manual_seed(5)
    layer = ColumnParallelLinear(m.hidden_size, padded_vocab_size(VOCAB, ps.tp, m.make_vocab_size_divisible_by),
                                 config=cfg, init_method=cfg.init_method, bias=False, gather_output=False,
                                 skip_bias_add=False).double()
    holder = torch.nn.Module()
    holder.output_layer, holder.post_process = layer, True

    b, s = 2, 8
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(s, b, m.hidden_size, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (b, s - 1), generator=g)
    mask = torch.zeros(b, s - 1, dtype=torch.bool)
    mask[0, [1, 2, 5]] = True          # model, tool, model
    mask[1, [0, 4, 5, 6]] = True
    weights = torch.randn(b, s - 1, generator=g, dtype=torch.float64)
    part = s // ps.tp

    def run(lean):
        local = hidden[ps.tp_rank * part:(ps.tp_rank + 1) * part].clone().requires_grad_()
        layer.weight.grad = None
        if lean:
            with trainable_logits(holder, mask):
                logits = layer(local)[0].transpose(0, 1)           # [1, K, V/tp]
            packed = A.vocab_parallel_logprobs(logits, targets[mask][None], ps.tp_group, vocab_size=VOCAB)
            logp = torch.zeros(b, s - 1, dtype=torch.float64).masked_scatter(mask, packed[0])
        else:
            logits = layer(local)[0].transpose(0, 1)               # [b, s, V/tp]
            tgt = torch.nn.functional.pad(targets, (0, 1))
            logp = A.vocab_parallel_logprobs(logits, tgt, ps.tp_group, vocab_size=VOCAB)[:, :-1] * mask
        (logp * weights).sum().backward()
        return logp.detach(), local.grad, layer.weight.grad.clone(), logits.shape[:2]

    lean, full = run(True), run(False)
    return {"flag_restored": layer.sequence_parallel is True,
            "logp_diff": max_abs_diff(lean[0], full[0]), "hidden_grad_diff": max_abs_diff(lean[1], full[1]),
            "weight_grad_diff": max_abs_diff(lean[2], full[2]),
            "grad_scale": float(full[2].abs().max()), "hidden_grad_scale": float(full[1].abs().max()),
            "lean_rows": tuple(lean[3]), "want_rows": (1, int(mask.sum()))}


def trainable_rank(rank, world) -> dict:
    """Runs after ``test_full_kl``'s checks in the same 2 ranks (world TP=2)."""
    from megatron.core import parallel_state as mpu

    from grpo_mega.distributed.state import init_parallel

    ps = init_parallel(2, 1, seed=11)
    res = {"tp2": _paths(ps), "sp": _sequence_parallel(ps)}
    mpu.destroy_model_parallel()
    res["pp2"] = _paths(init_parallel(1, 2, seed=11))
    return res


@functools.lru_cache(maxsize=None)
def _launch():
    from tests.unit.trainer.test_full_kl import shared_launch

    return [r["trainable"] for r in shared_launch()]


def _last_stages(layout):
    return [r[layout] for r in _launch() if r[layout]["stage_has_head"]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainable_logprobs_and_update_equal_the_all_positions_path(layout):
    """Guards the selection of the output layer's rows: a position off by one (the logits of
    the token itself, or of the one after), rows of one sequence taken from another, a tool
    token's position kept or a model token after the tool dropped, the reference scored at
    other positions than the policy, or values written back to the wrong cells would all
    move the old-policy log-probs, the loss, the exact KL or the gradients away from the
    path that scores every position (float64, TP=2 and PP=2)."""
    lasts = _last_stages(layout)
    assert lasts, "no rank held the output layer"
    for r in lasts:
        assert r["logp_diff"] <= 1e-12 * r["logp_scale"], r
        assert r["logp_zero_elsewhere"]
        assert r["kl"] > 1e-2, "the reference must differ from the policy for the KL to bite"
        assert r["clipfrac"] > 0, "the clip must act at some token"
        bad = {k: v for k, v in r["metrics_diff"].items() if not v <= 1e-10}
        assert not bad, bad
    for r in _launch():
        mine = r[layout]
        assert mine["grad_diff"] <= 1e-10 * mine["grad_scale"], mine


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_layer_never_sees_a_prompt_or_tool_position(layout):
    """Guards against logits computed for prompt, tool or padding positions (the output layer
    and the [rows, V/tp] logits and gradient growing with the non-trainable length): per
    micro-batch, the policy's output layer in the log-prob pass and in the update, and the
    reference's in the update, see exactly the trainable tokens (0 rows for a micro-batch
    with none); the all-positions path sees every position (the hook counts)."""
    for r in _last_stages(layout):
        want, every = r["want_rows"], r["all_rows"]
        assert want == [5, 0, 5], want
        assert r["rows"] == [want, want, want], r["rows"]
        assert r["rows_all"] == [every, every, every], r["rows_all"]


@pytest.mark.slow
def test_trainable_logits_under_sequence_parallel_gather_then_select():
    """Guards the sequence-parallel case: rows selected from the local sequence shard
    without the all-gather (wrong positions, or an index error), the layer's own gather
    left on (each rank's rows gathered tp times), the gather's backward reduce-scattering
    a gradient the layer already all-reduced (tp times too large), or the layer's
    ``sequence_parallel`` flag not restored after the forward."""
    for r in _launch():
        sp = r["sp"]
        assert sp["flag_restored"]
        assert sp["lean_rows"] == sp["want_rows"], sp
        assert sp["logp_diff"] <= 1e-12, sp
        assert sp["hidden_grad_diff"] <= 1e-12 * sp["hidden_grad_scale"], sp
        assert sp["weight_grad_diff"] <= 1e-12 * sp["grad_scale"], sp


def test_trainable_rows_are_sequence_major_in_mask_order():
    """Guards the index arithmetic on megatron's [s, b, h] layout: row ``t * b + i`` for
    sequence i, position t, listed in the loss mask's row-major order (the order the loss
    packs targets in); batch-major rows (``i * s + t``) would pick other tokens' states."""
    from grpo_mega.models.head import trainable_rows

    mask = torch.tensor([[False, True, True, False, True],
                         [True, False, False, False, True]])
    hidden = torch.arange(6 * 2).reshape(6, 2)  # [s=6, b=2]: the value is t * b + i
    picked = hidden.reshape(-1)[trainable_rows(mask)]
    want = [t * 2 + i for i in range(2) for t in range(5) if mask[i, t]]
    assert picked.tolist() == want == [2, 4, 8, 1, 9]
    assert trainable_rows(torch.zeros(3, 4, dtype=torch.bool)).numel() == 0
    with pytest.raises(ValueError, match="bool"):
        trainable_rows(mask.long())
