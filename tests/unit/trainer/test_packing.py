"""Packed (THD) micro-batches (``parallel.packing``, ``models.packing``) against today's padded
path, in float64: old-policy and reference log-probs within 1e-12, update gradients within
1e-10, for the exact ``full`` KL (reference run inside the update), k3 from the reference
pass, per-token advantages (process supervision), Dr. GRPO / seq-mean / token-mean
aggregation, the off-policy objective with TIS and ``behaviour``, and multi-turn masks
(tool tokens inside responses, a micro-batch with nothing to train).

TP=1 runs here in the test process (a single-rank world). TP=2, PP=2 and DP=2 run in the
2-rank launch that ``test_full_kl.py`` shares with ``test_trainable_logits.py``
(``packing_rank``), so packing adds no launch of its own.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.compare import max_abs_diff, max_abs_diff_all, worst
from tests.unit.trainer.test_batch import PROMPTS, RESPONSES
from tests.unit.trainer.test_trainable_logits import _episodes, _Grads, policy_and_reference

VOCAB, TEMP, CHUNK, MICRO = 50, 0.7, 3, 2
LOGP_TOL, GRAD_TOL = 1e-12, 1e-10


def _algos():
    from grpo_mega.config import AlgorithmConfig

    return {
        "full_kl_tis": AlgorithmConfig(kl_coef=0.5, kl_kind="full", clip_low=0.2, clip_high=0.28, tis_cap=2.0),
        "k3_drgrpo_per_token": AlgorithmConfig(kl_coef=0.3, kl_kind="k3", loss_agg="seq-mean-token-sum-norm"),
        "behaviour_seq_mean": AlgorithmConfig(kl_coef=0.0, off_policy="behaviour",
                                              loss_agg="seq-mean-token-mean"),
    }


def _run(ps, model, ref, *, packing: bool, micro: int, rows: slice) -> dict:
    """Reference and old-policy log-probs, then one update per algorithm, of the episodes'
    ``rows`` (this DP rank's share) in micro-batches of ``micro`` rows."""
    from grpo_mega.trainer.passes import compute_logprobs, metrics_to_floats, update_policy

    kw = dict(vocab_size=VOCAB, temperature=TEMP, chunk_size=CHUNK)
    b = dataclasses.replace(_episodes().slice(rows.start, rows.stop), packing=packing)
    # float64 buffers (the trainer's are float32), so the comparison sees fp64 rounding
    b.old_logp, b.ref_logp = (torch.zeros(b.loss_mask.shape, dtype=torch.float64) for _ in range(2))
    compute_logprobs(model, b.split(micro), ps, key="old_logp", **kw)
    compute_logprobs(ref, b.split(micro), ps, key="ref_logp", **kw)
    out = {"old": b.old_logp.clone(), "ref": b.ref_logp.clone(), "mask": b.loss_mask.clone()}
    # an old policy some way off, so the clip and the ratio's gradient both act
    g = torch.Generator().manual_seed(9)
    b.old_logp = out["old"] + 0.3 * torch.randn(out["old"].shape, generator=g) * b.loss_mask
    per_token = torch.randn(b.loss_mask.shape, generator=g) * b.loss_mask
    for name, algo in _algos().items():
        mb = dataclasses.replace(b, advantages=per_token) if "per_token" in name else b
        opt = _Grads(model)
        metrics = update_policy(model, opt, mb.split(micro), ps, algo, max_len=8, reuse_current_as_old=False,
                                reference=ref if algo.kl_kind == "full" else None, **kw)
        out[name] = dict(metrics=metrics_to_floats(metrics), grads=opt.grads)
    return out


def packed_paths(ps, rows: slice = slice(0, 6)) -> dict:
    """Padded (micro-batches of ``MICRO`` rows, and all rows as one micro-batch) and packed
    (``MICRO`` rows): the differences of log-probs, metrics and gradients, on this rank."""
    model, ref = policy_and_reference(ps)
    runs = {name: _run(ps, model, ref, packing=packing, micro=micro, rows=rows)
            for name, packing, micro in (("padded", False, MICRO), ("whole", False, 6), ("packed", True, MICRO))}
    res = {"stage_has_head": ps.is_last_stage, "algos": {}}
    if ps.is_last_stage:
        mask = runs["padded"]["mask"]
        for key in ("old", "ref"):
            res[f"{key}_diff"] = max_abs_diff(runs["packed"][key][mask], runs["padded"][key][mask])
            res[f"{key}_zero_elsewhere"] = bool((runs["packed"][key][~mask] == 0).all())
        res["logp_scale"] = float(runs["padded"]["old"][mask].abs().max())
    for name in _algos():
        pk, pd, wh = (runs[r][name] for r in ("packed", "padded", "whole"))
        a = {"grad_diff": max_abs_diff_all(pk["grads"], pd["grads"]),
             "grad_diff_whole": max_abs_diff_all(pk["grads"], wh["grads"]),
             "grad_scale": worst(float(x.abs().max()) for x in pd["grads"])}
        if ps.is_last_stage:
            a["metric_diff"] = {k: abs(pk["metrics"][k] - v) for k, v in pd["metrics"].items()
                                if k not in ("pad_frac", "grad_norm", "skipped")}
            a["loss"] = pd["metrics"]["loss"]
            a["pad_frac"] = (pk["metrics"]["pad_frac"], pd["metrics"]["pad_frac"])
        res["algos"][name] = a
    return res


def packing_rank(rank, world) -> dict:
    """TP=2, PP=2 and DP=2 (each rank half the rows) in the 2 ranks of ``test_full_kl``'s launch."""
    from megatron.core import parallel_state as mpu

    from grpo_mega.distributed.state import init_parallel

    res = {}
    for name, (tp, pp) in (("tp2", (2, 1)), ("pp2", (1, 2)), ("dp2", (1, 1))):
        mpu.destroy_model_parallel()
        ps = init_parallel(tp, pp, seed=11)
        rows = slice(3 * ps.dp_rank, 3 * ps.dp_rank + 3) if ps.dp > 1 else slice(0, 6)
        res[name] = packed_paths(ps, rows)
    return res


def check_packed_equals_padded(r: dict) -> None:
    """The assertions of one layout's ``packed_paths`` result."""
    if r["stage_has_head"]:
        for key in ("old", "ref"):
            assert r[f"{key}_diff"] <= LOGP_TOL, (key, r)
            assert r[f"{key}_zero_elsewhere"], key
        assert r["logp_scale"] > 0.5, "log-probs this small would hide a wrong position"
    for name, a in r["algos"].items():
        assert a["grad_scale"] > 1e-3, (name, a)
        assert a["grad_diff"] <= GRAD_TOL, (name, a)
        assert a["grad_diff_whole"] <= GRAD_TOL, (name, a)
        if r["stage_has_head"]:
            assert max(a["metric_diff"].values()) <= 1e-10, (name, a)
            assert abs(a["loss"]) > 1e-3, (name, a)


@pytest.fixture(scope="module")
def tp1():
    """The TP=1 results; the single-rank world is torn down after, because the xdist worker
    runs other files in this process (test_preflight_faults asserts no process group)."""
    from grpo_mega.distributed.state import destroy_parallel, init_parallel

    try:
        yield packed_paths(init_parallel(1, 1, seed=11))
    finally:
        destroy_parallel()


def test_packed_logprobs_equal_padded_tp1_fp64(tp1):
    """Guards attention across a sequence boundary (a row's queries seeing the previous
    row's keys) and RoPE positions not restarted per sequence (a row rotated by its offset in
    the pack): either moves every packed row after the first away from its padded log-probs
    by far more than 1e-12, for the policy's and the reference's pass alike."""
    for key in ("old", "ref"):
        assert tp1[f"{key}_diff"] <= LOGP_TOL, (key, tp1[f"{key}_diff"])
        assert tp1[f"{key}_zero_elsewhere"], key


def test_packed_update_gradients_equal_padded_tp1_fp64(tp1):
    """Guards a pad token (or a prompt / tool token) reaching the loss of a packed micro-batch,
    and a normaliser counted per micro-batch instead of over the global batch: the packed
    update in micro-batches of 2 rows must equal the padded update in the same micro-batches
    *and* in one micro-batch of all rows (where per-micro-batch and global counts coincide),
    to 1e-10, for the exact KL, k3 with per-token advantages under Dr. GRPO, and the
    ``behaviour`` objective with seq-mean."""
    check_packed_equals_padded(tp1)


def test_packing_pad_frac_counts_the_padding_each_layout_computes(tp1):
    """Guards ``pad_frac`` (share of computed positions that are padding) reporting the padded
    grid for packed micro-batches, or a share over micro-batches instead of positions: padded
    it is 1 - tokens / sum(b * s) of the trimmed micro-batches; packed there is no padding
    (no FP8, no sequence parallelism: multiple 1)."""
    tokens = sum(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES))
    grid = 0
    for i in range(0, len(PROMPTS), MICRO):
        lens = [len(p) + len(r) for p, r in zip(PROMPTS[i:i + MICRO], RESPONSES[i:i + MICRO])]
        grid += len(lens) * max(lens)
    for a in tp1["algos"].values():
        packed, padded = a["pad_frac"]
        assert packed == 0.0
        assert padded == pytest.approx(1 - tokens / grid, abs=1e-12) and padded > 0.1


def test_pack_rows_restarts_positions_and_bounds_every_segment():
    """Guards the packed layout itself: tokens out of order or with padding between rows, RoPE
    position ids not restarting, a tail not counted as its own segment (the tail's padding
    then attends into the last row and vice versa), and ``max_seqlen`` set to the pack's length
    (megatron then rotates each row by its offset in the pack instead of from 0), and the
    per-micro-batch boundaries / causal mask the local attention reads disagreeing with them."""
    from grpo_mega.models.packing import pack_rows, trainable_rows_packed
    from tests.unit.trainer.test_batch import _batch

    b = _batch()
    p = pack_rows(b.tokens, b.seq_lens, multiple=16)
    rows = [p_ + r for p_, r in zip(PROMPTS, RESPONSES)]
    flat = [t for r in rows for t in r]
    assert p.tokens.shape == (1, 32) and p.pad == 32 - len(flat) == 2
    assert p.tokens[0, :len(flat)].tolist() == flat and p.tokens[0, len(flat):].tolist() == [0] * 2
    assert p.position_ids[0].tolist() == [t for r in rows for t in range(len(r))] + [0, 1]
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + len(r))
    assert p.params.cu_seqlens_q.tolist() == p.params.cu_seqlens_kv.tolist() == cu + [32]
    assert p.params.cu_seqlens_q.dtype == torch.int32 and p.params.qkv_format == "thd"
    assert p.params.max_seqlen_q == p.params.max_seqlen_kv == max(len(r) for r in rows)
    # made once per micro-batch for every layer's attention: host boundaries, one causal mask
    assert p.params.host_cu_seqlens == tuple(cu + [32])
    n = p.params.max_seqlen_q
    assert torch.equal(p.params.causal[0, 0], torch.ones(n, n, dtype=torch.bool).triu(1))
    assert torch.equal(b.tokens[p.rows, p.cols], p.tokens[0, :len(flat)])
    # the trainable positions, packed, hold the same tokens' logits as the padded grid's
    k = trainable_rows_packed(b.loss_mask, p.starts)
    assert torch.equal(p.tokens[0, k + 1], b.targets[b.loss_mask])
    assert pack_rows(b.tokens, b.seq_lens).pad == 0
    with pytest.raises(ValueError, match="seq_lens"):
        pack_rows(b.tokens, [0] + b.seq_lens[1:])
