"""LoRA out of the trainer: the TP2xPP2 exports, checkpoints of adapters only resumed at other
layouts, and the PEFT / merged HF export loaded by ``peft`` and ``transformers``.

The multi-rank results come from the shared 4-rank launch (tests/scripts/bridge_ranks.py,
``_lora_checks``: qwen2 with QKV bias and tied embeddings, adapters rank 4 on every linear,
known random A and B); the assertions are here. The single-rank checks (the PEFT library on
the exported directory, refusals at resume) run in this process.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/checkpoint/test_lora_checkpoint.py
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import shutil

import pytest
import torch

from tests.compare import max_abs_diff, max_abs_diff_all
from tests.scripts import bridge_ranks
from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint
from tests.scripts.lora_fixtures import canonical_adapters, lora_config, merged_reference

HAS_PEFT = importlib.util.find_spec("peft") is not None
QWEN2_SEED = list(bridge_ranks.VARIANTS).index("qwen2_bias")  # the launch's seed for it


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return [rep["lora"] for rep in bridge_ranks.launch_once(tmp_path_factory)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The launch's qwen2 HF checkpoint (rebuilt: it is seeded), its config with LoRA, and
    the launch's adapters."""
    from grpo_mega.checkpoint import convert

    hf_dir = write_hf_checkpoint(tmp_path_factory.mktemp("lora_base") / "hf", "qwen2", tie=True, seed=QWEN2_SEED)
    cfg = lora_config(convert.read_model_config(hf_dir), rank=bridge_ranks.LORA_RANK,
                      alpha=bridge_ranks.LORA_ALPHA)
    return hf_dir, dataclasses.replace(cfg, hf_checkpoint=str(hf_dir)), canonical_adapters(cfg)


def test_lora_tp2_pp2_merged_export_is_base_plus_scaled_BA(ranks, base):
    """Guards against the merged export (sync ``merged``, the HF export) sending the base
    without its adapter, the adapter as tensors of its own, or a wrong merge at TP2xPP2
    (B's rows sharded wrongly on fused qkv / fc1, A's columns on proj / fc2, the scale):
    every HF tensor equals W + (alpha / r) B A merged in float64 (fp32 tolerance 1e-6)."""
    hf_dir, cfg, canon = base
    want = merged_reference(read_hf_tensors(hf_dir), cfg, canon)
    got = ranks[0]["merged"]
    assert sorted(got) == sorted(want)
    assert max_abs_diff_all(got, want) <= 1e-6
    assert max_abs_diff(got["model.layers.1.self_attn.q_proj.weight"],
                        read_hf_tensors(hf_dir)["model.layers.1.self_attn.q_proj.weight"]) > 1e-3


def test_lora_tp2_pp2_adapter_export_has_peft_names_and_split_rows(ranks, base):
    """Guards against the adapter-only export (sync ``adapter``) gathering A or B wrongly at
    TP2xPP2, losing a stage, or splitting fused B rows another way than the weight's (q/k/v
    interleaved per query group, [gate; up]): every PEFT tensor equals the one built from the
    known full adapters, bitwise, A shared by q, k and v (gate and up)."""
    from grpo_mega.bridge.lora import peft_pairs

    _, cfg, canon = base
    want = dict(p for name, (a, b) in canon.items() for p in peft_pairs(name, a, b, cfg))
    got = ranks[0]["peft"]
    assert sorted(got) == sorted(want) and len(got) == 2 * 7 * cfg.num_layers
    assert all(torch.equal(got[n], want[n]) for n in want)
    attn = "base_model.model.model.layers.0.self_attn."
    assert torch.equal(got[attn + "q_proj.lora_A.weight"], got[attn + "v_proj.lora_A.weight"])
    assert got[attn + "k_proj.lora_B.weight"].shape == (cfg.num_query_groups * 32, cfg.lora.rank)


def test_lora_checkpoint_holds_adapters_only_and_resumes_at_other_layouts(ranks, base):
    """Guards against a LoRA checkpoint storing the frozen base (the cost LoRA avoids), losing
    the base's reference, or resharding the adapters wrongly: saved at TP2xPP2, it holds only
    ``lora.*`` tensors and their Adam moments, and resumes at TP1, PP2 and TP2 with every A,
    B and moment bitwise equal (the moments a known function of their parameter)."""
    _, cfg, canon = base
    keys = ranks[0]["keys"]
    assert keys and all(k.startswith(("lora.", "optimizer.exp_avg.lora.", "optimizer.exp_avg_sq.lora."))
                        for k in keys), keys[:5]
    assert len([k for k in keys if k.startswith("lora.")]) == len(canon) * 2
    # rank-4 adapters of a 2-layer model: a few kB, where the base is ~0.5 MB
    base_bytes = sum(t.numel() * t.element_size() for t in read_hf_tensors(base[0]).values())
    assert ranks[0]["bytes"] < base_bytes / 4
    for tp, pp in bridge_ranks.LORA_LAYOUTS:
        reports = [r[f"resume tp{tp} pp{pp}"] for r in ranks]
        assert all(r["wrong"] == [] and r["moments wrong"] == 0 and r["adam_step"] == 3.0 for r in reports)
        assert sorted({n for r in reports for n in r["names"]}) == sorted(canon), (tp, pp)


@contextlib.contextmanager
def _one_rank(tmp_path):
    """A TP=1 ParallelState in a world of this process, torn down after (xdist runs other
    files in the same process), with the checkpoint writer's Manager process a save starts."""
    from megatron.core import parallel_state as mpu

    from grpo_mega.checkpoint.io import release_checkpoint_writer
    from grpo_mega.distributed.state import init_parallel

    own = not torch.distributed.is_initialized()
    if own:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_parallel(1, 1)
    finally:
        release_checkpoint_writer()
        mpu.destroy_model_parallel()
        if own:
            torch.distributed.destroy_process_group()


def _our_logits(cfg, hf_dir, canon, tokens, tmp_path) -> torch.Tensor:
    """Our megatron model (TP=1, in this process) with the launch's adapters: logits [b, s, V]."""
    from grpo_mega.models import forward_logits

    from tests.scripts.lora_fixtures import lora_model, set_adapters

    with _one_rank(tmp_path) as ps:
        model = lora_model(cfg, ps, hf_dir)
        set_adapters(model, cfg, ps, canon)
        with torch.no_grad():
            return forward_logits(model, tokens)[..., :cfg.vocab_size].float()


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed (pip install peft; the test extra has it)")
def test_lora_peft_export_loads_in_peft_and_gives_our_logits(ranks, base, tmp_path):
    """Guards against a PEFT directory that PEFT loads wrongly or not at all (names, the A/B
    orientation, fused rows split another way, target_modules in megatron's names, r or
    lora_alpha wrong): ``peft.PeftModel.from_pretrained`` on the HF base with the exported
    directory gives our megatron LoRA model's logits (fp32, 1e-5), and so does transformers
    on the ``--merged`` export; the base alone does not."""
    import peft
    import transformers
    from safetensors.torch import save_file

    hf_dir, cfg, canon = base
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(ranks[0]["peft files"], str(adapter / "adapter_model.safetensors"))
    config = dict(ranks[0]["peft config"], base_model_name_or_path=str(hf_dir))
    assert (config["r"], config["lora_alpha"]) == (cfg.lora.rank, cfg.lora.alpha)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = _our_logits(cfg, hf_dir, canon, tokens, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        plain = hf(tokens).logits
        theirs = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()(tokens).logits
    assert max_abs_diff(ours, theirs) <= 1e-5
    assert max_abs_diff(ours, plain) > 1e-3
    merged = tmp_path / "merged"
    merged.mkdir()
    save_file(ranks[0]["merged files"], str(merged / "model.safetensors"))
    shutil.copyfile(hf_dir / "config.json", merged / "config.json")
    with torch.no_grad():
        m = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
        assert max_abs_diff(ours, m(tokens).logits) <= 1e-5


def test_lora_resume_refuses_another_base_or_a_full_model(base, tmp_path):
    """Guards against resuming adapters on a base they were not trained on (another model,
    silently: the checkpoint holds no base weights to notice it by) and against loading an
    adapters-only checkpoint into a run without ``model.lora`` (the model left as the base):
    both are refused before any tensor loads, naming the flag to fix."""
    from grpo_mega.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from grpo_mega.config import OptimizerConfig
    from grpo_mega.models import build_model
    from grpo_mega.optim import build_optimizer

    from tests.scripts.lora_fixtures import lora_model

    hf_dir, cfg, _ = base
    with _one_rank(tmp_path) as ps:
        model = lora_model(cfg, ps, hf_dir)
        opt = build_optimizer(model, OptimizerConfig(), ps)
        common = json.loads(json.dumps({"model": dataclasses.asdict(cfg)}, default=str))
        ckpt = save_checkpoint(tmp_path / "ckpt", 1, model, opt, ps, common)
        other = write_hf_checkpoint(tmp_path / "other", "qwen2", tie=True, seed=99)  # same shapes
        with pytest.raises(CheckpointError, match=r"other weights.*--model\.hf_checkpoint"):
            load_checkpoint(ckpt, model, opt, ps, dataclasses.replace(cfg, hf_checkpoint=str(other)))
        plain_cfg = dataclasses.replace(cfg, lora=None)
        plain = build_model(plain_cfg, ps)
        with pytest.raises(CheckpointError, match=r"holds LoRA adapters.*--model\.lora\.rank=4"):
            load_checkpoint(ckpt, plain, build_optimizer(plain, OptimizerConfig(), ps), ps, plain_cfg)
        load_checkpoint(ckpt, model, opt, ps, cfg)  # the right base loads
