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


def _run(ps, model, ref, *, packing: bool, micro: int, rows: slice, budget: int = 0, fillers: int = 0) -> dict:
    """Reference and old-policy log-probs, then one update per algorithm, of the episodes'
    ``rows`` (this DP rank's share) in micro-batches of ``micro`` rows, or binned under a
    ``budget`` of tokens (rows reordered; results put back in row order) with ``fillers``
    extra micro-batches of nothing to train."""
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, metrics_to_floats, update_policy

    kw = dict(vocab_size=VOCAB, temperature=TEMP, chunk_size=CHUNK)
    b = dataclasses.replace(_episodes().slice(rows.start, rows.stop), packing=packing)
    b, sizes, order = plan_micro_batches(b, len(b), micro, budget, ps.dp_group if ps.dp > 1 else None,
                                         ps.device)
    sizes = [sizes[0] + [0] * fillers]
    back = torch.argsort(torch.tensor(order))
    # float64 buffers (the trainer's are float32), so the comparison sees fp64 rounding
    b.old_logp, b.ref_logp = (torch.zeros(b.loss_mask.shape, dtype=torch.float64) for _ in range(2))
    compute_logprobs(model, cut(b, sizes)[0], ps, key="old_logp", **kw)
    compute_logprobs(ref, cut(b, sizes)[0], ps, key="ref_logp", **kw)
    out = {"old": b.old_logp[back].clone(), "ref": b.ref_logp[back].clone(), "mask": b.loss_mask[back].clone(),
           "micro_batches": len(sizes[0])}
    # an old policy some way off, so the clip and the ratio's gradient both act (drawn in row order)
    g = torch.Generator().manual_seed(9)
    b.old_logp = (out["old"] + 0.3 * torch.randn(out["old"].shape, generator=g) * out["mask"])[order]
    per_token = (torch.randn(out["mask"].shape, generator=g) * out["mask"])[order]
    for name, algo in _algos().items():
        mb = dataclasses.replace(b, advantages=per_token) if "per_token" in name else b
        opt = _Grads(model)
        metrics = update_policy(model, opt, cut(mb, sizes)[0], ps, algo, max_len=8, reuse_current_as_old=False,
                                reference=ref if algo.kl_kind == "full" else None, **kw)
        out[name] = dict(metrics=metrics_to_floats(metrics), grads=opt.grads)
    return out


BUDGET, FILLERS = 6, 1  # tokens per micro-batch (the 7-token row runs alone), extra empty micro-batches


def packed_paths(ps, rows: slice = slice(0, 6), budget: int = BUDGET, fillers: int = FILLERS) -> dict:
    """Padded (micro-batches of ``MICRO`` rows, and all rows as one micro-batch), packed
    (``MICRO`` rows) and packed under a token ``budget`` (plus ``fillers``): the differences of
    log-probs, metrics and gradients of both packed runs from the padded one, on this rank."""
    model, ref = policy_and_reference(ps)
    runs = {name: _run(ps, model, ref, packing=packing, micro=micro, rows=rows, **kw)
            for name, packing, micro, kw in (("padded", False, MICRO, {}), ("whole", False, 6, {}),
                                             ("packed", True, MICRO, {}),
                                             ("budget", True, MICRO, dict(budget=budget, fillers=fillers)))}
    res = {"stage_has_head": ps.is_last_stage, "algos": {}, "micro_batches": runs["budget"]["micro_batches"]}
    if ps.is_last_stage:
        mask = runs["padded"]["mask"]
        for key in ("old", "ref"):
            res[f"{key}_diff"] = worst(max_abs_diff(runs[r][key][mask], runs["padded"][key][mask])
                                       for r in ("packed", "budget"))
            res[f"{key}_zero_elsewhere"] = all(bool((runs[r][key][~mask] == 0).all()) for r in ("packed", "budget"))
        res["logp_scale"] = float(runs["padded"]["old"][mask].abs().max())
    for name in _algos():
        pk, bg, pd, wh = (runs[r][name] for r in ("packed", "budget", "padded", "whole"))
        a = {"grad_diff": worst(max_abs_diff_all(x["grads"], pd["grads"]) for x in (pk, bg)),
             "grad_diff_whole": worst(max_abs_diff_all(x["grads"], wh["grads"]) for x in (pk, bg)),
             "grad_scale": worst(float(x.abs().max()) for x in pd["grads"])}
        if ps.is_last_stage:
            keys = [k for k in pd["metrics"] if k not in ("pad_frac", "tokens_per_micro_batch", "grad_norm", "skipped")]
            a["metric_diff"] = {k: abs(pk["metrics"][k] - pd["metrics"][k]) for k in keys}
            # other micro-batches: the float32 per-micro-batch metric means round differently
            a["metric_rel_diff_budget"] = {k: abs(bg["metrics"][k] - pd["metrics"][k]) / max(abs(pd["metrics"][k]), 1.0)
                                           for k in keys}
            a["loss_diff_budget"] = abs(bg["metrics"]["loss"] - pd["metrics"]["loss"])
            a["loss"] = pd["metrics"]["loss"]
            a["pad_frac"] = (pk["metrics"]["pad_frac"], pd["metrics"]["pad_frac"])
            a["tokens_per_micro_batch"] = {r: runs[r][name]["metrics"]["tokens_per_micro_batch"] for r in runs}
        res["algos"][name] = a
    return res


def packing_rank(rank, world) -> dict:
    """TP=2, PP=2 and DP=2 (each rank half the rows) in the 2 ranks of ``test_full_kl``'s launch."""
    from tests.distributed import world2_layouts

    res = {}
    for name, ps, rows in world2_layouts():
        # DP=2 under 8 tokens: rank 0's rows (5, 6, 3 tokens) fit 2 micro-batches, rank 1's
        # (7, 3, 6) need 3, so the count must be agreed (rank 0 then runs 3)
        res[name] = packed_paths(ps, rows, **(dict(budget=8, fillers=0) if ps.dp > 1 else {}))
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
            assert worst(a["metric_diff"].values()) <= 1e-10, (name, a)
            assert worst(a["metric_rel_diff_budget"].values()) <= 1e-6, (name, a)
            assert a["loss_diff_budget"] <= 1e-12, (name, a)
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


def test_packing_token_budget_bins_every_row_once_under_the_budget():
    """Guards the token-budget planner (``parallel.max_tokens_per_micro_batch``): a row lost or
    trained twice by the reordering, a micro-batch over the budget while a row could move, a
    row longer than the budget sharing its micro-batch, and more micro-batches than LPT needs."""
    from grpo_mega.trainer.microbatches import bins_needed, cut, lpt_bins, plan_micro_batches
    from tests.unit.trainer.test_batch import _batch

    lens = [5, 6, 3, 7, 3, 6]
    assert lpt_bins(lens, 3) == [[3, 4], [0, 1], [2, 5]]  # 10 / 11 / 9: longest first, lightest bin
    assert bins_needed(lens, 30) == 1 and bins_needed(lens, 11) == 3 and bins_needed(lens, 10) == 4 and bins_needed([5, 6, 3], 8) == 2
    b = _batch()
    assert b.seq_lens == lens
    out, sizes, order = plan_micro_batches(b, len(b), 2, max_tokens=6)
    assert sorted(order) == list(range(6)) and out.seq_lens == [lens[i] for i in order]
    assert torch.equal(out.tokens, b.tokens[order]) and torch.equal(out.loss_mask, b.loss_mask[order])
    micro = cut(out, sizes)[0]
    assert len(micro) == bins_needed(lens, 6) == 5
    assert [mb.seq_lens for mb in micro if 7 in mb.seq_lens] == [[7]]  # over the budget: alone
    assert all(mb.num_tokens <= 6 for mb in micro if 7 not in mb.seq_lens)
    filler = cut(out, [sizes[0] + [0]])[0][-1]
    assert filler.filler and filler.num_tokens == 0 and not filler.loss_mask.any()


def test_packing_tokens_per_micro_batch_metric(tp1):
    """Guards ``tokens_per_micro_batch``: the mean real tokens per micro-batch of the update
    (30 tokens in 3 micro-batches of 2 rows; under 6 tokens, 5 micro-batches and a filler of 0)."""
    for a in tp1["algos"].values():
        t = a["tokens_per_micro_batch"]
        assert t["padded"] == t["packed"] == pytest.approx(10.0) and t["whole"] == pytest.approx(30.0)
        assert t["budget"] == pytest.approx(5.0)


def test_packing_token_budget_below_the_longest_sequence_is_refused_naming_the_flag():
    """Guards a token budget that cannot hold a full-length single-turn sequence (every such row
    would run alone, over the budget the memory plan counts): refused at start-up naming
    ``--parallel.max_tokens_per_micro_batch``; a budget that holds it frees the row count's
    divisibility rule."""
    from grpo_mega.config import ConfigError, load_config
    from grpo_mega.preflight.validate import validate

    base = ["--data.max_prompt_tokens=100", "--rollout.max_new_tokens=28", "--parallel.micro_batch_size=3"]
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch=127 .* at least 128"):
        validate(load_config(None, [*base, "--parallel.max_tokens_per_micro_batch=127"]), 1, check_hardware=False)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        validate(load_config(None, base), 1, check_hardware=False)
    validate(load_config(None, [*base, "--parallel.max_tokens_per_micro_batch=128"]), 1, check_hardware=False)


def test_packing_is_on_by_default_and_in_every_shipped_config():
    """Guards packing left off where it is exact: the default config and every shipped config
    (``grpo_mega/configs``, ``launch/configs``) pack their micro-batches, and the scale configs
    bin them under a token budget that holds their longest sequence."""
    from grpo_mega.config import ParallelConfig, load_config
    from tests import REPO

    assert ParallelConfig().packing
    shipped = sorted((REPO / "grpo_mega" / "configs").glob("*.yaml")) + sorted((REPO / "launch" / "configs").glob("*.yaml"))
    assert len(shipped) >= 7
    for path in shipped:
        cfg = load_config(str(path), [])
        assert cfg.parallel.packing, path
        if path.parent.name == "launch":
            longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
            assert cfg.parallel.max_tokens_per_micro_batch >= longest, path


def test_packed_attention_length_groups_put_each_row_back_in_pack_order():
    """Guards the per-length batching of the packed local attention handing a row's output to
    another row's positions (the gather's inverse permutation wrong, or the permutation used
    as its own inverse): the fp64 equality tests pack micro-batches of two rows, where the
    groups hardly reorder anything. Here lengths are interleaved (3, 5, 3, 5, 1), as the
    attention's forward consumes them: per group ``[n, rows]`` positions, outputs concatenated
    row-major, then ``inverse``; every position must come back to itself, and every group
    column must be one whole segment."""
    from types import SimpleNamespace

    from grpo_mega.models.packing import _length_groups

    cu = [0, 3, 8, 11, 16, 17]
    groups, inverse = _length_groups(SimpleNamespace(), cu, torch.device("cpu"))
    x = torch.arange(cu[-1])
    out = torch.cat([x[idx].t().flatten() for _, idx in groups]).index_select(0, inverse)
    assert torch.equal(out, x), out
    segments = sorted(tuple(col.tolist()) for n, idx in groups for col in idx.t())
    assert segments == [tuple(range(a, b)) for a, b in zip(cu[:-1], cu[1:])], segments
