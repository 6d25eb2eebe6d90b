"""LoRA on the megatron actor (``grpo_mega.lora``, ``model.lora``), in float64.

TP=1 runs in the test process; TP=2, PP=2 and DP=2 run in the 2-rank launch that
``tests/unit/trainer/test_full_kl.py`` shares (``lora_rank``), so LoRA adds no launch. The
base weights, A and B are drawn whole per canonical name and sharded by megatron's rules, so
every layout holds the same model; each layout's log-probs and adapter gradients (gathered to
canonical full tensors) must equal TP=1's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.compare import max_abs_diff, worst
from tests.unit.trainer.test_batch import _model_cfg
from tests.unit.trainer.test_trainable_logits import VOCAB, TEMP, CHUNK, _episodes

TOL = 1e-10
LORA = dict(rank=4, alpha=8.0)


def _weight_name(name: str) -> str:
    """The base weight whose sharding an adapter tensor follows (B of a column-parallel
    linear: its rows; A of a row-parallel one: its columns); None for a replicated one."""
    lin = name.rsplit(".lora_", 1)[0]
    column = lin.endswith(("linear_qkv", "linear_fc1"))
    if (".lora_B." in name) == column:
        return lin + ".weight"
    return None


def _canonical_model(ps, lora: bool):
    """A float64 model whose canonical weights are drawn per name (the same at any layout),
    with adapters whose A and B are too (B nonzero), when ``lora``."""
    from grpo_mega import lora as L
    from grpo_mega.config import LoraConfig
    from grpo_mega.models import build_model
    from grpo_mega.models import layout as lay

    cfg = _model_cfg()
    torch.manual_seed(21)
    model = build_model(cfg, ps).double()
    full = lay.canonical_state_dict(model, ps, cfg.num_layers, cfg.vocab_size)
    for i, name in enumerate(sorted(full)):
        g = torch.Generator().manual_seed(1000 + sum(map(ord, name)) * 7 + len(name))
        full[name] = 0.1 * torch.randn(full[name].shape, generator=g, dtype=torch.float64)
    lay.load_canonical(model, full, ps, cfg.num_layers, cfg.vocab_size)
    if lora:
        L.attach_lora(model, LoraConfig(**LORA), ps, seed=5)
        model.initial_adapters = _full_grads(model, ps, cfg.num_layers, grads=False)
        _draw_adapters(model, ps, cfg.num_layers)
    return model


def _draw_adapters(model, ps, num_layers: int) -> None:
    from grpo_mega import lora as L
    from grpo_mega.models import layout as lay

    per = num_layers // ps.pp
    with torch.no_grad():
        for local, p in L.lora_named_parameters(model):
            name = lay.to_global_name(local, ps.pp_rank, per)
            w = _weight_name(name)
            full_shape = list(p.shape)
            if w is not None:
                dim, _ = lay.split_rule(w)
                full_shape[dim] *= ps.tp
            g = torch.Generator().manual_seed(sum(map(ord, name)) * 13 + len(name))
            full = 0.2 * torch.randn(full_shape, generator=g, dtype=torch.float64)
            p.copy_(full if w is None else lay.shard(w, full, ps.tp_rank, ps.tp))


def _full_grads(model, ps, num_layers: int, grads: bool = True) -> dict:
    """Adapter gradients (or, ``grads=False``, the adapters) as canonical full tensors, the
    gradients summed over DP, keyed by global name."""
    import torch.distributed as dist

    from grpo_mega import lora as L
    from grpo_mega.models import layout as lay

    per, out = num_layers // ps.pp, {}
    for local, p in L.lora_named_parameters(model):
        g = (p.grad if grads else p).detach().clone()
        if ps.dp > 1 and grads:
            dist.all_reduce(g, group=ps.dp_group)
        name = lay.to_global_name(local, ps.pp_rank, per)
        w = _weight_name(name)
        out[name] = g if w is None or ps.tp == 1 else lay.gather(w, g, ps.tp_group, ps.tp)
    return out


class _LoraGrads:
    """The optimizer ``update_policy`` steps: keeps the adapter gradients, moves nothing."""

    def __init__(self, model):
        from grpo_mega import lora as L
        self.params = [p for _, p in L.lora_named_parameters(model)]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        return {"grad_norm": 0.0, "skipped": False}


def lora_paths(ps, rows: slice = slice(0, 6)) -> dict:
    """On this rank: the LoRA model's log-probs with adapters on and off (through
    ``ReferenceView``), a base model's built without LoRA, and the adapter gradients of one
    update with the exact KL against the view (and k3 from its log-probs)."""
    from grpo_mega import lora as L
    from grpo_mega.config import AlgorithmConfig
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    cfg = _model_cfg()
    kw = dict(vocab_size=VOCAB, temperature=TEMP, chunk_size=CHUNK)
    base, model = _canonical_model(ps, lora=False), _canonical_model(ps, lora=True)
    ref = L.ReferenceView(model)
    b = _episodes().slice(rows.start, rows.stop)
    b, sizes, _ = plan_micro_batches(b, len(b), 2, 0, ps.dp_group if ps.dp > 1 else None, ps.device)
    b.old_logp, b.ref_logp = (torch.zeros(b.loss_mask.shape, dtype=torch.float64) for _ in range(2))
    out = {"mask": b.loss_mask.clone(), "last": ps.is_last_stage, "initial": model.initial_adapters}
    for key, m in (("lora", model), ("view", ref), ("base", base)):
        b.old_logp.zero_()
        compute_logprobs(m, cut(b, sizes)[0], ps, key="old_logp", **kw)
        out[key] = b.old_logp.clone()
    b.ref_logp = out["view"].clone()
    # an old policy some way off, drawn over all rows so a DP rank's share gets its rows' noise
    whole = _episodes().loss_mask.shape
    noise = torch.randn(whole, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    noise = noise[rows.start:rows.stop, :out["mask"].shape[1]]
    b.old_logp = out["lora"] + 0.3 * noise * out["mask"]
    for name, algo in (("full", AlgorithmConfig(kl_coef=0.5, kl_kind="full", clip_low=0.2, clip_high=0.28)),
                       ("k3", AlgorithmConfig(kl_coef=0.3, kl_kind="k3"))):
        update_policy(model, _LoraGrads(model), cut(b, sizes)[0], ps, algo, max_len=8,
                      reuse_current_as_old=False, reference=ref if algo.kl_kind == "full" else None, **kw)
        out[f"grads_{name}"] = _full_grads(model, ps, cfg.num_layers)
    out["base_grads_none"] = all(p.grad is None for n, p in model.named_parameters() if not L.is_lora_name(n))
    return out


def lora_rank(rank, world) -> dict:
    """TP=2, PP=2 and DP=2 in the 2 ranks of ``test_full_kl``'s launch."""
    from tests.distributed import world2_layouts

    return {name: lora_paths(ps, rows) for name, ps, rows in world2_layouts()}


@pytest.fixture(scope="module")
def tp1():
    from grpo_mega.distributed.state import destroy_parallel, init_parallel

    try:
        yield lora_paths(init_parallel(1, 1, seed=11))
    finally:
        destroy_parallel()


def test_lora_reference_view_equals_a_separately_built_base_model(tp1):
    """Guards the reference for free: ``adapters_disabled`` leaving an adapter on (the KL then
    measured against the policy itself, 0), or the view computing something other than the
    frozen base: its log-probs must equal a model built without LoRA from the same weights,
    and differ from the adapted policy's (B is nonzero here)."""
    m = tp1["mask"]
    assert max_abs_diff(tp1["view"][m], tp1["base"][m]) <= 1e-12
    assert max_abs_diff(tp1["lora"][m], tp1["base"][m]) > 1e-3, "the adapters changed nothing"


def test_lora_with_zero_b_starts_as_the_base_model():
    """Guards an adapter that is not a no-op at start (B not zero, or the scale applied to A's
    init twice into the output): a fresh ``attach_lora`` must leave every log-prob of the base
    bit for bit, and freeze every base parameter."""
    from grpo_mega import lora as L
    from grpo_mega.config import LoraConfig
    from grpo_mega.distributed.state import destroy_parallel, init_parallel
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs

    try:
        ps = init_parallel(1, 1, seed=11)
        model = _canonical_model(ps, lora=False)
        b = _episodes()
        b, sizes, _ = plan_micro_batches(b, len(b), 2, 0, None, ps.device)
        kw = dict(vocab_size=VOCAB, temperature=TEMP, chunk_size=CHUNK)
        b.old_logp = torch.zeros(b.loss_mask.shape, dtype=torch.float64)
        compute_logprobs(model, cut(b, sizes)[0], ps, key="old_logp", **kw)
        before = b.old_logp.clone()
        L.attach_lora(model, LoraConfig(**LORA), ps, seed=5)
        assert all(not p.requires_grad for n, p in model.named_parameters() if not L.is_lora_name(n))
        assert len(L.lora_named_parameters(model)) == 2 * 4 * _model_cfg().num_layers
        assert all(p.requires_grad for _, p in L.lora_named_parameters(model))
        compute_logprobs(model, cut(b, sizes)[0], ps, key="old_logp", **kw)
        assert torch.equal(b.old_logp, before)
    finally:
        destroy_parallel()


def test_lora_step_moves_only_the_adapters():
    """Guards the base training under LoRA (a frozen flag lost, or the optimizer built over
    every parameter): one real ``update_policy`` with the trainer's optimizer must leave every
    base parameter bit for bit, give none of them a gradient, and move the adapters."""
    from grpo_mega import lora as L
    from grpo_mega.config import AlgorithmConfig, OptimizerConfig
    from grpo_mega.distributed.state import destroy_parallel, init_parallel
    from grpo_mega.optim import build_optimizer
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import update_policy

    try:
        ps = init_parallel(1, 1, seed=11)
        model = _canonical_model(ps, lora=True)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not L.is_lora_name(n)}
        adapters = {n: p.detach().clone() for n, p in L.lora_named_parameters(model)}
        opt = build_optimizer(model, OptimizerConfig(lr=1e-2), ps)
        b = _episodes()
        b, sizes, _ = plan_micro_batches(b, len(b), 2, 0, None, ps.device)
        b.old_logp = torch.zeros(b.loss_mask.shape, dtype=torch.float64)
        update_policy(model, opt, cut(b, sizes)[0], ps, AlgorithmConfig(kl_coef=0.0), max_len=8,
                      reuse_current_as_old=True, vocab_size=VOCAB, temperature=TEMP, chunk_size=CHUNK)
        for n, p in model.named_parameters():
            if n in base:
                assert torch.equal(p.detach(), base[n]) and p.grad is None, n
        moved = [n for n, p in L.lora_named_parameters(model) if not torch.equal(p.detach(), adapters[n])]
        assert len(moved) == len(adapters), sorted(set(adapters) - set(moved))
    finally:
        destroy_parallel()


def test_lora_init_is_the_same_at_any_layout():
    """Guards an A drawn per rank (or per local layer index): ``attach_lora`` draws each A whole
    from the seed and the linear's global name, so two calls give the same A and different
    layers different ones."""
    from grpo_mega.lora import LORA_INITS, _seed

    assert _seed(5, "decoder.layers.1.mlp.linear_fc1") == _seed(5, "decoder.layers.1.mlp.linear_fc1")
    assert _seed(5, "decoder.layers.1.mlp.linear_fc1") != _seed(5, "decoder.layers.0.mlp.linear_fc1")
    g = torch.Generator().manual_seed(0)
    a = LORA_INITS["kaiming"]((4, 64), g)
    assert float(a.abs().max()) <= 1 / 8 and float(a.abs().max()) > 0.1


def check_lora_equals_tp1(r: dict, ref: dict) -> None:
    if r["last"]:
        m = ref["mask"]
        rows = r["mask"].shape[0]
        off = 0 if rows == m.shape[0] else None
        if off is not None:
            for key in ("lora", "view"):
                assert max_abs_diff(r[key][m], ref[key][m]) <= 1e-12, key
    for algo in ("initial", "full", "k3"):
        mine, want = (r[algo], ref[algo]) if algo == "initial" else (r[f"grads_{algo}"], ref[f"grads_{algo}"])
        assert set(mine) <= set(want) and mine, (algo, sorted(mine))
        assert worst(max_abs_diff(mine[n], want[n]) for n in mine) <= TOL, algo
        assert worst(float(want[n].abs().max()) for n in mine) > 1e-4
    assert r["base_grads_none"]


def test_lora_gradients_tp1_are_nonzero_for_a_and_b(tp1):
    """Guards a dead adapter path (the hook not registered, or its output dropped): every A and
    B gets a gradient with B nonzero, for the exact KL and k3 alike."""
    for algo in ("full", "k3"):
        g = tp1[f"grads_{algo}"]
        assert len(g) == 2 * 4 * _model_cfg().num_layers
        assert all(float(t.abs().max()) > 0 for t in g.values()), algo
    assert tp1["base_grads_none"]


def check_lora_layout(layout: str, results: list, tp1: dict) -> None:
    """The assertions of one layout of ``lora_rank``'s results (both ranks) against TP=1's."""
    if layout == "pp2":
        merged = dict(results[1])
        for key in ("grads_full", "grads_k3", "initial"):
            merged[key] = {**results[0][key], **results[1][key]}
        merged["base_grads_none"] = results[0]["base_grads_none"] and results[1]["base_grads_none"]
        check_lora_equals_tp1(merged, tp1)
        return
    for r in results:
        if layout == "dp2":
            r = dict(r, last=False)  # each rank scores half the rows; the gradients are summed
        check_lora_equals_tp1(r, tp1)
