"""Precision: FP8 requests checked at start-up, FP8 fields reach megatron, bf16 master weights.

The FP8 GEMMs themselves need a GPU with Transformer Engine (tests/gpu/); here the
hardware facts are passed in, and megatron's own TransformerConfig validates the fields.
"""
from __future__ import annotations

import pytest
import torch

from grpo_mega.config import ConfigError, OptimizerConfig, load_config

from grpo_mega.preflight.validate import validate
from grpo_mega.models.precision import fp8_enabled, fp8_problem, seq_multiple

H100 = dict(cuda=True, capability=(9, 0), device_name="H100")


@pytest.mark.parametrize("fp8, recipe, facts, needle", [
    ("hybrid", "delayed", dict(cuda=False, capability=None, te_version="2.8.0"), "needs a CUDA GPU"),
    ("hybrid", "delayed", dict(cuda=True, capability=(8, 0), te_version="2.8.0", device_name="A100"),
     "compute capability >= 8.9, but A100 has 8.0"),
    ("e4m3", "tensorwise", dict(H100, te_version=None), "needs Transformer Engine"),
    ("hybrid", "tensorwise", dict(H100, te_version="2.1.0"), "Transformer Engine >= 2.2"),
    ("hybrid", "blockwise", dict(cuda=True, capability=(10, 0), te_version="2.8.0", device_name="B200"),
     "Hopper"),
    ("hybrid", "mxfp8", dict(H100, te_version="2.8.0"), ">= 10.0"),
    ("fp16", "delayed", dict(H100, te_version="2.8.0"), "model.fp8='fp16'"),
])
def test_fp8_request_names_what_is_missing(fp8, recipe, facts, needle):
    """Guards against FP8 failing deep inside TE (or silently running bf16) on hardware
    or software that cannot run the requested recipe."""
    problem = fp8_problem(fp8, recipe, **facts)
    assert problem is not None and needle in problem, problem


@pytest.mark.parametrize("fp8, recipe, facts", [
    ("none", "delayed", dict(cuda=False, capability=None, te_version=None)),
    ("hybrid", "delayed", dict(H100, te_version="2.8.0")),
    ("e4m3", "blockwise", dict(H100, te_version="2.3.0.dev0+abc")),
    ("hybrid", "mxfp8", dict(cuda=True, capability=(10, 0), te_version="2.4.0")),
    ("hybrid", "tensorwise", dict(cuda=True, capability=(8, 9), te_version="2.2.0")),
])
def test_fp8_request_accepted_where_supported(fp8, recipe, facts):
    assert fp8_problem(fp8, recipe, **facts) is None


@pytest.mark.parametrize("overrides, needle", [
    (["--model.fp8=hybrid", "--model.dtype=bfloat16"], "needs a CUDA GPU.*--model.fp8=none"),
    (["--model.fp8=true"], "model.fp8='true' is not one of"),
    (["--model.fp8=hybrid", "--model.fp8_recipe=fancy"], "model.fp8_recipe='fancy'"),
])
def test_fp8_on_this_machine_is_a_start_up_error(overrides, needle):
    """Guards against an FP8 run starting on a machine without a GPU or TE (this one)."""
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(None, overrides), 1)


@pytest.mark.parametrize("overrides, needle", [
    (["--model.reference_fp8=true"], "reference_fp8=true needs an FP8 format"),
    (["--model.fp8=hybrid"], "must be bfloat16"),
    (["--model.fp8=hybrid", "--model.dtype=bfloat16", "--model.hidden_size=120",
      "--model.num_attention_heads=4"], "hidden_size=120 to be a multiple of 16"),
])
def test_fp8_and_optimizer_layout_errors_name_the_flag(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(None, overrides), 1, check_hardware=False)


def test_distributed_optimizer_flag_starts_and_builds_the_sharded_optimizer():
    """Guards against ``optimizer.use_distributed_optimizer=true`` being refused at start-up
    or silently ignored (the unsharded optimizer built instead), and against the DP=1 path
    of the sharded optimizer (its slice is the whole buffer, no collectives) diverging from
    ``ParallelAdamW`` over three clipped, weight-decayed steps. Multi-rank: tests/unit/optim."""
    import copy
    import dataclasses

    from grpo_mega.optim import DistributedAdamW, ParallelAdamW, build_optimizer

    validate(load_config(None, ["--optimizer.use_distributed_optimizer=true"]), 1)
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    b, init = copy.deepcopy(a), copy.deepcopy(a)
    cfg = OptimizerConfig(lr=1e-2, clip_grad=0.1, weight_decay=0.1)
    sharded = build_optimizer(a, dataclasses.replace(cfg, use_distributed_optimizer=True), _ps())
    plain = build_optimizer(b, cfg, _ps())
    assert isinstance(sharded, DistributedAdamW) and isinstance(plain, ParallelAdamW)
    x = torch.randn(5, 4)
    for _ in range(3):
        infos = []
        for model, opt in ((a, sharded), (b, plain)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            infos.append(opt.step())
        assert infos[0]["clip_coef"] < 1.0 and abs(infos[0]["grad_norm"] - infos[1]["grad_norm"]) < 1e-6
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-7, rtol=0), (p, q)
    assert not torch.equal(a[0].weight, init[0].weight)  # the steps moved the weights


def _ps():
    from grpo_mega.distributed.state import ParallelState
    return ParallelState(rank=0, world_size=1, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                         tp_group=None, pp_group=None, dp_group=None, mp_group=None,
                         embedding_group=None, device=torch.device("cpu"))


def test_fp8_fields_reach_megatron_and_reference_stays_bf16():
    """Guards against FP8 flags that never reach megatron's TransformerConfig (which then
    trains in bf16 while the logs say FP8), and against the reference model silently
    running FP8 when only the actor asked for it. megatron validates the fields itself."""
    from grpo_mega.models import transformer_config

    cfg = validate(load_config(None, ["--model.fp8=hybrid", "--model.dtype=bfloat16",
                                      "--model.fp8_recipe=tensorwise"]), 1, check_hardware=False)
    m = cfg.model
    actor = transformer_config(m, _ps(), use_te=True, fp8=fp8_enabled(m, frozen=False))
    ref = transformer_config(m, _ps(), use_te=True, fp8=fp8_enabled(m, frozen=True))
    assert (actor.fp8, actor.fp8_recipe, actor.bf16) == ("hybrid", "tensorwise", True)
    assert ref.fp8 is None and ref.bf16
    m.reference_fp8 = True
    assert transformer_config(m, _ps(), use_te=True, fp8=fp8_enabled(m, frozen=True)).fp8 == "hybrid"
    m.fp8_recipe = "delayed"
    delayed = transformer_config(m, _ps(), use_te=True, fp8=True)
    assert (delayed.fp8_amax_history_len, delayed.fp8_amax_compute_algo) == (1024, "max")
    with pytest.raises(ValueError, match="Transformer Engine layer spec"):
        transformer_config(m, _ps(), use_te=False, fp8=True)


def test_local_spec_without_te_and_fp8_micro_batches_pad_to_16():
    """Guards against selecting TE layers on a machine without TE, and against FP8 GEMMs
    failing on token counts that are not a multiple of 16."""
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.models import build_model, te_available
    from grpo_mega.distributed import cpu_compat

    cpu_compat.apply()
    assert not te_available()
    cfg = load_config(None, ["--model.vocab_size=64", "--model.hidden_size=32",
                             "--model.num_attention_heads=2", "--model.num_query_groups=1",
                             "--model.ffn_hidden_size=64", "--model.num_layers=1"]).model
    from megatron.core import parallel_state as mpu
    import torch.distributed as dist
    from grpo_mega.distributed.state import free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        model = build_model(cfg, _ps())
        names = {type(mod).__name__ for mod in model.modules()}
        assert not any(n.startswith("TE") for n in names), names
        assert "ColumnParallelLinear" in names
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()

    rows = ([[1, 2, 3], [1]], [[4, 5], [6, 7, 8, 9]], [[-0.5, -0.25], [-1.0] * 4], [0.0, 0.0])
    fp8 = load_config(None, ["--model.fp8=hybrid"]).model
    (mb,) = TrainingBatch.pack(*rows, pad_id=0, pad_to_multiple=seq_multiple(fp8)).split(2)
    (plain,) = TrainingBatch.pack(*rows, pad_id=0, pad_to_multiple=seq_multiple(cfg)).split(2)
    assert mb.tokens.shape == (2, 16) and plain.tokens.shape == (2, 5)
    assert torch.equal(mb.loss_mask[:, :4], plain.loss_mask) and not mb.loss_mask[:, 4:].any()
    assert torch.equal(mb.rollout_logp[:, :4], plain.rollout_logp)


def test_bf16_training_keeps_fp32_master_weights_and_main_grads():
    """Guards against AdamW applied to bf16 weights directly: an update below half a bf16
    ulp (2^-8 at 1.0) is rounded away every step and the model never moves, and summing
    micro-batch gradients in bf16 drops the small ones."""
    from grpo_mega.optim.adamw import ParallelAdamW

    w16 = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        w16.weight.fill_(1.0)
    w32 = torch.nn.Parameter(torch.ones(1, 4))
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0)
    opt = ParallelAdamW(w16, cfg, _ps())
    ref = torch.optim.AdamW([w32], lr=1e-3, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0)
    assert opt.mixed and opt.main[0].dtype == torch.float32

    # Two micro-batches whose bf16 sum rounds: 1 + 2^-9 == 1 in bf16.
    big = torch.ones(1, 4, dtype=torch.bfloat16)
    small = torch.full((1, 4), 2.0 ** -9, dtype=torch.bfloat16)
    for step in range(10):
        opt.zero_grad()
        w16(big).sum().backward()
        w16(small).sum().backward()
        if step == 0:
            opt.reduce_grads()
            assert torch.all(opt.main[0].grad == 1.0 + 2.0 ** -9), opt.main[0].grad
            assert w16.weight.grad is None  # moved into the fp32 main grad
            info = opt.step(reduce=False)
        else:
            info = opt.step()
        assert not info["skipped"]
        w32.grad = torch.full((1, 4), 1.0 + 2.0 ** -9)
        ref.step()
    assert torch.allclose(opt.main[0].detach(), w32.detach(), atol=1e-7, rtol=0)
    assert torch.equal(w16.weight.detach(), w32.detach().to(torch.bfloat16))
    assert float(w16.weight[0, 0]) < 1.0  # ten steps of ~1e-3 moved the bf16 copy by an ulp


def test_gpu_ready_mxfp8_pads_sequences_to_32_as_megatron_says():
    """Guards against issue 27's defect 7: mxfp8 padded micro-batch sequences to 16 tokens,
    while megatron's ``fp8_utils.get_fp8_align_size`` (mxfp8's 32-element scaling blocks)
    says 32; the other recipes keep 16, and sequence parallelism's TP multiple joins in."""
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        m = load_config(None, ["--model.fp8=hybrid", f"--model.fp8_recipe={recipe}"]).model
        assert seq_multiple(m) == get_fp8_align_size(Fp8Recipe(recipe)), recipe
    m = load_config(None, ["--model.fp8=hybrid", "--model.fp8_recipe=mxfp8",
                           "--model.sequence_parallel=true"]).model
    assert seq_multiple(m) == 32 and seq_multiple(m, tp=3) == 96


def _fake_te(root, body: str):
    pkg = root / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch.py").write_text(body)


def test_gpu_ready_transformer_engine_never_falls_back_silently(tmp_path, monkeypatch, caplog):
    """Guards against issue 27's defect 5: a Transformer Engine that failed to import made a
    GPU job build megatron's local layers without a word (unfused attention, [b, heads, s, s]
    scores the budget does not count). On GPU: a broken TE install is an error naming the
    cause and --model.transformer_impl; a required one too; a missing one under ``auto`` is
    a loud warning naming the flag; ``local`` and CPU jobs build the local spec quietly."""
    import sys

    from grpo_mega.models.precision import choose_te, te_import_error

    assert te_import_error() == "not installed"  # this CPU machine
    with caplog.at_level("WARNING"):
        assert choose_te("cuda", "auto") is False
    assert "LOCAL layers" in caplog.text and "--model.transformer_impl=local" in caplog.text
    with pytest.raises(RuntimeError, match="not installed.*--model.transformer_impl=local"):
        choose_te("cuda", "transformer_engine")
    caplog.clear()
    assert choose_te("cuda", "local") is False and choose_te("cpu", "auto") is False
    assert not caplog.text
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        choose_te("cpu", "transformer_engine")
    # An installed but broken TE (the CPU meta package raises RuntimeError at import).
    _fake_te(tmp_path, "raise RuntimeError('empty meta package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="empty meta package.*--model.transformer_impl=local"):
            choose_te("cuda", "auto")
        assert choose_te("cuda", "local") is False
    finally:  # the fake package must not outlive the test in sys.modules
        for k in [k for k in sys.modules if k.startswith("transformer_engine")]:
            del sys.modules[k]
    with pytest.raises(ConfigError, match="--model.transformer_impl"):
        validate(load_config(None, ["--model.transformer_impl=te"]))
