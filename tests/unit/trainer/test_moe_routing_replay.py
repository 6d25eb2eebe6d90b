"""MoE routing replay (``algorithm.routing_replay``): config checks, the batch's routing
layout, and one 2-rank launch (tests/scripts/moe_replay_ranks.py) running the trainer's
real ``stages.logprobs`` / ``stages.update`` on a tiny Qwen3-MoE at TP1, EP2, TP2 and PP2,
with the experts each forward used observed by hooks on megatron's routers.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/trainer/test_moe_routing_replay.py
"""
from __future__ import annotations

import pytest
import torch

from grpo_mega.config import ConfigError, load_config
from grpo_mega.models.routing import from_router_rows, to_router_rows
from grpo_mega.preflight.validate import validate
from grpo_mega.trainer.batch import TrainingBatch
from tests.compare import assert_close, worst
from tests.scripts import moe_replay_ranks as M

MOE = ["--model.family=qwen3_moe", "--model.num_experts=4", "--model.moe_ffn_hidden_size=16"]


# ------------------------------------------------------------------------------ single process

@pytest.mark.parametrize("overrides, needle", [
    (["--algorithm.routing_replay=replay", *MOE], "Model Runner V2 requires Triton"),
    (["--algorithm.routing_replay=record-in-trainer"], "has no experts"),
    (["--algorithm.routing_replay=record-in-trainer", "--model.recompute=full", *MOE], "recompute=full"),
    (["--algorithm.routing_replay=R2", *MOE], "is not one of"),
])
def test_moe_routing_replay_config_errors_name_the_field(overrides, needle):
    """Guards against accepting a routing replay the code cannot do: the engine's routing
    (vLLM 0.32 on CPU returns none), replay on a dense model, or a recomputed backward that
    would route anew; the error names the field and its flag."""
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(None, overrides), 1, check_hardware=False)


def test_moe_record_in_trainer_validates_for_an_moe_model():
    """Guards against the checks refusing the supported mode at TP2 x EP2."""
    validate(load_config(None, ["--algorithm.routing_replay=record-in-trainer", *MOE, "--parallel.ep=2",
                                "--parallel.tp=2", "--data.prompts_per_step=4"]), 4, check_hardware=False)


def test_expert_rows_are_sequence_major_like_megatrons_router():
    """Guards against handing a router its targets in batch-major order (megatron flattens
    [s, b, h] activations: row t * b + i is token t of sequence i) or with layers swapped."""
    b, s, n_layers, k = 3, 5, 2, 2
    routed = torch.zeros(b, s, n_layers, k, dtype=torch.int16)
    for i in range(b):
        for t in range(s):
            for layer in range(n_layers):
                routed[i, t, layer] = torch.tensor([100 * layer + 10 * i + t, 7])
    rows = to_router_rows(routed)
    assert rows.shape == (n_layers, s * b, k) and rows.dtype == torch.long
    assert rows[1, 4 * b + 2, 0] == 100 + 20 + 4
    assert torch.equal(from_router_rows(rows[1], b, s), routed[:, :, 1].long())


def test_batch_slices_and_saves_routing_with_the_tokens():
    """Guards against micro-batch views whose routing is not trimmed with their tokens (the
    replay would then misalign positions) or a recorded batch that loses its routing."""
    batch = TrainingBatch.pack([[5, 6, 7], [8]], [[9, 10], [11]], [[0.0, 0.0], [0.0]], [1.0, -1.0], pad_id=0)
    batch.routed_experts = batch.empty_routing(2, 2)
    assert batch.routed_experts.shape == (2, 5, 2, 2) and bool((batch.routed_experts == -1).all())
    batch.routed_experts.copy_(torch.arange(40, dtype=torch.int16).reshape(2, 5, 2, 2))
    second = batch.slice(1, 2)
    assert second.routed_experts.shape[:2] == second.tokens.shape == (1, 2)
    assert torch.equal(second.routed_experts, batch.routed_experts[1:2, :2])


def test_batch_save_keeps_routing(tmp_path):
    """Guards against ``logging.record_batches`` files that drop the recorded routing."""
    batch = TrainingBatch.pack([[5, 6]], [[9]], [[0.0]], [1.0], pad_id=0)
    batch.routed_experts = torch.arange(12, dtype=torch.int16).reshape(1, 3, 2, 2)
    batch.save(tmp_path / "b.pt")
    assert torch.equal(TrainingBatch.load(tmp_path / "b.pt").routed_experts, batch.routed_experts)


# ------------------------------------------------------------------------------ 2 ranks

@pytest.fixture(scope="module")
def reports():
    return M.launch()


LAYOUT_KEYS = [f"tp{tp} pp{pp} ep{ep}" for tp, pp, ep in M.LAYOUTS]


def _recorded(run, j: int, layer: int) -> torch.Tensor:
    """Micro-batch j's recorded routing of ``layer``, experts sorted: [b, s, k]."""
    start, n = run["micro_rows"][j]
    s = run["shapes"][j][1]
    return run["routed"][start:start + n, :s, layer].long().sort(-1).values


def _flips(run) -> int:
    """Tokens x layers whose experts differ between the old-policy pass and the update."""
    return sum(int((run["old_seen"][j][layer] != run["update_seen"][j][layer]).any(-1).sum())
               for j in range(len(run["shapes"])) for layer in run["old_seen"][j])


@pytest.mark.parametrize("layout", LAYOUT_KEYS)
def test_moe_recorded_routing_is_what_the_old_policy_forward_used(reports, layout):
    """Guards against recording at shifted positions, into the wrong layer's slot, in the
    wrong row order, or into a micro-batch view that does not alias the step's batch: the
    recorded experts must equal, at every token of every micro-batch and layer this rank
    holds, the experts megatron's router used in the old-policy pass."""
    for r in reports:
        run = r[f"{layout} record-in-trainer"]
        assert run["routed"] is not None and run["replayed_flag"]
        for j in range(len(run["shapes"])):
            assert run["old_seen"][j], "no router ran"
            for layer, seen in run["old_seen"][j].items():
                assert torch.equal(_recorded(run, j, layer), seen), (layer, j)


@pytest.mark.parametrize("layout", LAYOUT_KEYS)
def test_moe_update_forward_replays_exactly_the_old_policy_routing(reports, layout):
    """Guards against an update that routes itself (replay never enabled), replays a
    position-shifted or another layer's routing, or replays one micro-batch's routing into
    another: every update forward must use exactly the recorded experts, although with
    replay off the same step flips some tokens' experts (checked, so this test can fail)."""
    for r in reports:
        run, off = r[f"{layout} record-in-trainer"], r[f"{layout} off"]
        assert off["routed"] is None and not off["replayed_flag"]
        for j in range(len(run["shapes"])):
            for layer, seen in run["update_seen"][j].items():
                assert torch.equal(_recorded(run, j, layer), seen), (layer, j)
        assert _flips(run) == 0
    assert sum(_flips(r[f"{layout} off"]) for r in reports) > 0, "no flip without replay: the test proves nothing"


def test_moe_recorded_routing_does_not_depend_on_the_layout(reports):
    """Guards against EP, TP or PP changing which experts a token is recorded with (tokens
    routed on another rank's rows, a TP rank routing a different copy, a PP stage recording
    the other stage's layers): each layout's record equals TP1/PP1/EP1's, row for row."""
    def by_row(layout):
        rows = {}
        for r in reports:
            run = r[f"{layout} record-in-trainer"]
            per = M.GLOBAL // run["dp"]
            for j, (start, n) in enumerate(run["micro_rows"]):
                s = run["shapes"][j][1]
                for layer in run["old_seen"][j]:
                    for i in range(n):
                        rows[(run["dp_rank"] * per + start + i, layer)] = _recorded(run, j, layer)[i, :s]
        return rows

    base = by_row(LAYOUT_KEYS[0])
    assert len(base) == M.GLOBAL * 2
    for layout in LAYOUT_KEYS[1:]:
        other = by_row(layout)
        assert other.keys() == base.keys(), layout
        for key, v in other.items():
            n = min(len(v), len(base[key]))  # micro-batches trim to their own longest row
            assert torch.equal(v[:n], base[key][:n]), (layout, key)


def test_moe_old_vs_update_logprob_gap_is_reported(reports, capsys):
    """Guards against a gap measurement that measures something else: mini-batch 2's mean
    |logp - old_logp| after one optimizer step must equal an independent fp64 reference
    (a forward-only pass over mini-batch 2 right after that step, same routing mode; the
    mean taken here over every replica's response tokens), at every layout and mode. A
    gap over padding, signed, per sequence, of another mini-batch, or not reduced over DP
    fails it; so does a zero gap or a NaN. The numbers are in docs/guides/moe.md."""
    lines = []
    for layout in LAYOUT_KEYS:
        gaps = {}
        for mode in ("off", "record-in-trainer"):
            runs = [r[f"{layout} {mode}"] for r in reports]
            measured = [run["gap_mb2"] for run in runs if run["is_last_stage"]]
            total = sum(run["ref_gap_sum"] for run in runs)
            tokens = sum(run["ref_gap_tokens"] for run in runs)
            assert tokens > 0, (layout, mode, "the reference saw no tokens")
            ref = total / tokens
            assert ref > 1e-3, (layout, mode, ref, "one optimizer step moved nothing: the test proves nothing")
            for g in measured:  # every last-stage rank reports the DP-reduced gap
                assert_close(torch.tensor(g, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                             rtol=1e-4, atol=1e-7, msg=f"{layout} {mode}: gap {g} vs reference {ref}")
            gaps[mode] = worst(measured)
        flips = sum(_flips(r[f"{layout} off"]) for r in reports)
        lines.append(f"{layout}: gap off {gaps['off']:.5f}, record-in-trainer {gaps['record-in-trainer']:.5f}, "
                     f"flips without replay {flips} (summed over ranks; TP ranks repeat)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_moe_packed_routing_replay_equals_padded_at_ep2(reports):
    """Guards routing replay with packing (``parallel.packing``) at EP2: the packed forward's
    routing written to the wrong grid slots (packed order read as the padded sequence-major
    order), a replay that feeds the packed forward the grid's order or gives the tail's
    padding unrecorded (-1) experts, or packed rows routed differently from padded ones: at
    every real token the packed run records the padded run's experts, its old-policy and
    update forwards use exactly those, and mini-batch 2's log-prob gap equals the padded run's.
    The packed run also bins rows under a token budget (``parallel.max_tokens_per_micro_batch``),
    which guards a DP rank with a different micro-batch count: rank 0's first mini-batch fits
    one micro-batch, rank 1's needs two, and both must run three in all."""
    layout = "tp{} pp{} ep{}".format(*M.PACKED)
    assert [r[f"{layout} record-in-trainer packed"]["micro_batches"] for r in reports] == [3, 3]
    for r in reports:
        pad, pk = r[f"{layout} record-in-trainer"], r[f"{layout} record-in-trainer packed"]
        assert pk["replayed_flag"] and len(pk["packed_index"]) == len(pk["shapes"]) > 1
        for j, (rows, cols) in enumerate(pk["packed_index"]):
            assert torch.equal(pk["routed"][rows, cols], pad["routed"][rows, cols]), j
            for seen_pass in ("old_seen", "update_seen"):
                assert pk[seen_pass][j], "no router ran"
                for layer, seen in pk[seen_pass][j].items():
                    want = pk["routed"][rows, cols, layer].long().sort(-1).values  # [total, k]
                    assert torch.equal(seen[0, :len(rows)], want), (seen_pass, layer, j)
        assert_close(torch.tensor(pk["gap_mb2"], dtype=torch.float64),
                     torch.tensor(pad["gap_mb2"], dtype=torch.float64), rtol=1e-4, atol=1e-7)
        assert pk["gap_mb2"] > 1e-3


def test_moe_packed_update_equals_padded_at_ep2_fp64(reports):
    """Guards packing under expert parallelism in float64 (no load-balancing loss): a packed
    micro-batch's tokens reaching the wrong experts or another row's keys, a pad token in
    the loss, or a normaliser counted per micro-batch: at EP2 the old-policy log-probs of
    micro-batches packed under a token budget equal the padded ones within 1e-12 and every
    rank's gradients (its experts' too, which hold both ranks' tokens) within 1e-10."""
    for r in reports:
        f = r["fp64 ep2 packed"]
        assert f["micro_batches"] == (2, 2), f
        assert f["logp_scale"] > 0.5 and f["grad_scale"] > 1e-3, f
        assert f["logp_diff"] <= 1e-12, f
        assert f["grad_diff"] <= 1e-10, f
