"""Precision: FP8 requests checked at start-up, FP8 fields reach megatron, bf16 master weights.

The FP8 GEMMs themselves need a GPU with Transformer Engine (tests/gpu/); here the
hardware facts are passed in, and megatron's own TransformerConfig validates the fields.
"""
from __future__ import annotations

import contextlib

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
    ("hybrid", "blockwise", dict(cuda=True, capability=(8, 9), te_version="2.20.2", device_name="L40S"),
     ">= 9.0, but L40S has 8.9"),
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


@contextlib.contextmanager
def _megatron_world_of_one():
    """A gloo world of this one process with megatron's groups (TP = PP = 1), CPU-patched."""
    from megatron.core import parallel_state as mpu
    import torch.distributed as dist
    from grpo_mega.distributed import cpu_compat
    from grpo_mega.distributed.state import free_port
    cpu_compat.apply()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the RNG streams a forward forks
    try:
        yield
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


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
    with _megatron_world_of_one():
        model = build_model(cfg, _ps())
        names = {type(mod).__name__ for mod in model.modules()}
        assert not any(n.startswith("TE") for n in names), names
        assert "ColumnParallelLinear" in names

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


def test_gpu_ready_blockwise_fp8_allowed_on_blackwell():
    """Guards against issue 39 finding 8: ``blockwise`` was refused on Blackwell (sm100),
    where Transformer Engine emulates it (TE's support matrix; TE's own probe, which
    check_fp8_here also asks, knows where its version cannot); Hopper still runs it."""
    for cap in ((9, 0), (10, 0), (12, 0)):
        assert fp8_problem("hybrid", "blockwise", cuda=True, capability=cap, te_version="2.20.2") is None


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_gpu_ready_sequence_parallel_fp8_pads_each_rank_to_the_alignment(recipe):
    """Guards against issue 39 finding 6: with sequence parallelism FP8 micro-batches were
    padded to lcm(align, tp), but TE checks each TP rank's rows (s/tp) against the alignment
    before its all-gather: 16 at TP 4 leaves 4 rows per rank (mxfp8: 32 at TP 2, 16 rows)."""
    from grpo_mega.models.precision import fp8_align_size

    m = load_config(None, ["--model.fp8=hybrid", f"--model.fp8_recipe={recipe}",
                           "--model.sequence_parallel=true"]).model
    align = fp8_align_size(recipe)
    for tp in (1, 2, 4, 8):
        s = seq_multiple(m, tp)
        assert s % tp == 0 and (s // tp) % align == 0, (recipe, tp, s)


def test_gpu_ready_broken_te_error_names_the_rebuild_against_this_torch(tmp_path, monkeypatch, caplog):
    """Guards against issue 39 finding 4: TE's torch part, built by pip in an isolated
    environment against PyPI's newest torch, fails to import against the machine's torch,
    and the error told the user to run that same install again (pip install -e '.[gpu]').
    It must name the rebuild without build isolation (and without pip's cached wheel); the
    command's version is the gpu extra's pin, and the GPU guide shows the same commands."""
    import re
    import sys
    from pathlib import Path

    from grpo_mega.models.precision import TE_VERSION, choose_te, te_install_command

    root = Path(__file__).resolve().parents[3]
    pin = re.search(r"transformer-engine\[[^\]]*\]==([0-9.]+)", (root / "setup.py").read_text())
    assert pin and pin[1] == TE_VERSION
    rebuild = te_install_command(reinstall=True)
    for flag in ("--no-build-isolation", "--no-cache-dir", "--force-reinstall", f"=={TE_VERSION}"):
        assert flag in rebuild
    assert "--no-build-isolation" in te_install_command("13.0") and "core_cu13" in te_install_command("13.0")
    guide = (root / "docs/guides/gpu.md").read_text()
    assert rebuild in guide and te_install_command("13.0") in guide
    with caplog.at_level("WARNING"):  # not installed: the warning names the install
        choose_te("cuda", "auto")
    assert "--no-build-isolation" in caplog.text
    _fake_te(tmp_path, "raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="undefined symbol") as e:
            choose_te("cuda", "auto")
        assert rebuild in str(e.value) and "--model.transformer_impl=local" in str(e.value)
    finally:
        for k in [k for k in sys.modules if k.startswith("transformer_engine")]:
            del sys.modules[k]


def _fp8_stage(cfg):
    """A megatron model whose config says FP8, as TE leaves it after a forward: its
    TE-like submodule's ``is_first_microbatch`` is False (reuse the cached FP8 cast)."""
    from grpo_mega.models import build_model

    model = build_model(cfg, _ps())
    model.config.fp8 = "hybrid"  # after construction: megatron's check reads the field only
    model.output_layer.is_first_microbatch = False
    return model


def test_gpu_ready_fp8_weight_casts_refreshed_for_policy_and_reference():
    """Guards against issue 39 finding 7: with PP > 1 and ``kl_kind: full`` megatron's
    schedule runs the policy+reference wrapper, which lacked ``set_is_first_microbatch``,
    so TE never recast the policy's FP8 weights after its first step (megatron refreshes the
    model it runs at each step's first micro-batch, if it has the method). At PP = 1 the
    schedule runs the policy alone, so the reference riding along must be refreshed too."""
    import inspect

    from megatron.core.pipeline_parallel import schedules

    from grpo_mega.distributed.schedule import _WithReference, run_microbatches

    assert "set_is_first_microbatch" in inspect.getsource(schedules.forward_step)  # megatron's side
    cfg = load_config(None, ["--model.vocab_size=64", "--model.hidden_size=32",
                             "--model.num_attention_heads=2", "--model.num_query_groups=1",
                             "--model.ffn_hidden_size=64", "--model.num_layers=1"]).model
    with _megatron_world_of_one():
        policy, ref = _fp8_stage(cfg), _fp8_stage(cfg)
        runner = _WithReference(policy, ref)  # PP > 1
        assert hasattr(runner, "set_is_first_microbatch")
        runner.set_is_first_microbatch()
        assert policy.output_layer.is_first_microbatch and ref.output_layer.is_first_microbatch
        ref.output_layer.is_first_microbatch = False  # PP = 1: a real schedule run
        ref.config.fp8 = policy.config.fp8 = None  # the forward itself runs without TE
        ref.set_is_first_microbatch = lambda: setattr(ref.output_layer, "is_first_microbatch", True)
        mb = {"tokens": torch.zeros(1, 4, dtype=torch.long)}
        run_microbatches(policy, [mb], lambda out, mb, ref_out: (out.sum(), {}), _ps(),
                         forward_only=True, reference=ref)
        assert ref.output_layer.is_first_microbatch
