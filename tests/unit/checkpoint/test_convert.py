"""HF <-> megatron-core conversion: round trips through TP/PP layouts, the CLIs, bad input.

The multi-rank checks share one 4-rank launch with tests/unit/bridge/test_sync.py
(tests/scripts/bridge_ranks.py); the CLIs run as subprocesses, as a user runs them.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/checkpoint/test_convert.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_mega.checkpoint import convert
from grpo_mega.models.hf import MappingError, MissingTensorError, ShapeMismatchError
from tests.scripts import bridge_ranks
from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint
from tests import REPO

REPO = REPO
ROUND_TRIP = list(bridge_ranks.VARIANTS)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return bridge_ranks.launch_once(tmp_path_factory)


def _one(reports, key):
    vals = bridge_ranks.merged(reports, key)
    assert vals, f"no rank reported {key!r}"
    return vals


@pytest.mark.parametrize("variant", ROUND_TRIP)
def test_hf_to_mcore_to_hf_is_bitwise_identical(reports, variant):
    """Guards against any lossy step (dtype, QKV grouping, fc1 halves, vocabulary
    padding, tied lm_head) in HF -> torch_dist -> HF, converted by 4 ranks together."""
    assert _one(reports, f"roundtrip {variant}") == {0: []}


@pytest.mark.parametrize("tp,pp", bridge_ranks.LAYOUTS)
@pytest.mark.parametrize("variant", ROUND_TRIP)
def test_mcore_checkpoint_loads_at_layout_and_bridge_exports_original(reports, variant, tp, pp):
    """Guards against resharding bugs on load (TP slices, layer offsets per stage, the
    tied copy on the last stage, vocabulary padding per TP) and on export (TP gathers,
    PP broadcast): every rank must get the original HF tensors back, bit for bit."""
    vals = _one(reports, f"export {variant} tp{tp} pp{pp}")
    assert len(vals) == 4 and all(v == [] for v in vals.values()), vals


@pytest.mark.parametrize("variant", list(bridge_ranks.VARIANTS))
def test_megatron_logits_match_transformers(reports, variant):
    """Guards against a mapping that round-trips but means something else (e.g. q/k
    swapped consistently both ways): the megatron model must compute HF's logits."""
    assert _one(reports, f"logits {variant}")[0] <= 1e-4


def test_qwen3_qk_norm_exports_bitwise_at_tp2_pp2(reports):
    """Guards against the QK-norm tensors of Qwen3 being lost or misplaced."""
    vals = _one(reports, "export qwen3_qknorm tp2 pp2")
    assert all(v == [] for v in vals.values()), vals


@pytest.mark.parametrize("variant", ROUND_TRIP)
def test_direct_hf_load_equals_mcore_checkpoint_load(reports, variant):
    """Guards against the trainer's two start paths (HF dir, converted checkpoint)
    producing different TP2xPP2 shards."""
    assert all(_one(reports, f"hf_load_equals_mcore_load {variant}").values())


def test_load_rejects_checkpoint_with_other_shapes(reports):
    """Guards against a silent partial load (megatron loads the vocabulary with
    allow_shape_mismatch): the error names the tensor and both shapes."""
    msg = _one(reports, "bad shape")[0]
    assert "linear_fc1.weight" in msg and "(2, 384, 128)" in msg and "(2, 512, 128)" in msg


def test_failed_conversion_leaves_nothing_behind(reports):
    """Guards against a half-written checkpoint directory that a later run would trust."""
    assert all("injected failure" in v for v in _one(reports, "failed conversion").values())
    assert _one(reports, "failed conversion leftovers")[0] == []


# ------------------------------------------------------------------------------ CLIs

def _run(args, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("cli") / "llama", "llama", tie=False, seed=7)


def test_tools_print_help():
    """Guards against a CLI that needs heavy imports (or a GPU) just to print --help."""
    for tool in ("tools/convert_checkpoint.py", "tools/verify_checkpoint.py"):
        r = _run([tool, "--help"], timeout=60)
        assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
    r = _run(["tools/convert_checkpoint.py", "mcore-to-hf", "--help"], timeout=60)
    assert "--hf-config" in r.stdout


@pytest.mark.slow  # the converter CLI in subprocesses: ~20 s, out of make test-fast
def test_cli_round_trip_and_logit_check(llama_dir, tmp_path):
    """Guards against the CLIs drifting from the package: HF -> mcore -> HF through the
    command line is bitwise, and verify_checkpoint reports matching logits."""
    mc, back = tmp_path / "mcore", tmp_path / "back"
    r = _run(["tools/convert_checkpoint.py", "hf-to-mcore", "--hf-dir", str(llama_dir), "--out", str(mc)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[hf-to-mcore] done" in r.stdout and "linear_qkv.weight" in r.stdout
    r = _run(["tools/convert_checkpoint.py", "mcore-to-hf", "--in", str(mc), "--out", str(back)])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_hf_tensors(llama_dir), read_hf_tensors(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((back / "config.json").read_text()) == json.loads((llama_dir / "config.json").read_text())
    r = _run(["tools/verify_checkpoint.py", "--hf-dir", str(llama_dir), "--mcore-dir", str(mc)])
    assert r.returncode == 0 and "[verify] OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "max |logits_hf - logits_mcore|" in r.stdout


@pytest.mark.slow  # a torchrun or multi-process launch: ~20-30 s, out of make test-fast
def test_gpu_ready_cli_under_torchrun_shares_one_world_and_one_output(llama_dir, tmp_path):
    """Guards against issue 27's defect 8: under torchrun every process of
    tools/convert_checkpoint.py started its own 1-rank world, converted everything and
    raced the others on renaming --out (one failed "already exists", or files of two
    writers mixed). Both directions under torchrun with 2 ranks: the ranks form one world
    (rank 1 converts its share), and the round trip is bitwise."""
    mc, back = tmp_path / "mcore", tmp_path / "back"
    run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "tools/convert_checkpoint.py"]
    r = _run([*run, "hf-to-mcore", "--no-progress", "--hf-dir", str(llama_dir), "--out", str(mc)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "[hf-to-mcore] rank 1 " in r.stdout and r.stdout.count("[hf-to-mcore] done") == 2, r.stdout
    r = _run([*run, "mcore-to-hf", "--no-progress", "--in", str(mc), "--out", str(back)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    a, b = read_hf_tensors(llama_dir), read_hf_tensors(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _leftovers(tmp_path, "mcore") == ["mcore"] and _leftovers(tmp_path, "back") == ["back"]


# ------------------------------------------------------------------------------ bad input

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.tmp")]


def test_shape_mismatch_names_tensor_and_both_shapes(llama_dir, tmp_path):
    """Guards against converting a checkpoint whose weights do not fit its config.json."""
    bad = _copy(llama_dir, tmp_path / "bad")
    _edit_config(bad, intermediate_size=200)
    with pytest.raises(ShapeMismatchError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*"
                                                 r"\(192, 128\).*\(200, 128\)"):
        convert.hf_to_mcore(bad, tmp_path / "out", progress=None)
    assert _leftovers(tmp_path, "out") == []


def test_cli_bad_input_exits_2_with_the_message(llama_dir, tmp_path):
    """Guards against a traceback (or exit 0) instead of a named error from the CLI."""
    bad = _copy(llama_dir, tmp_path / "bad")
    _edit_config(bad, num_key_value_heads=4)
    r = _run(["tools/convert_checkpoint.py", "hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "o")],
             timeout=120)
    assert r.returncode == 2 and "k_proj.weight" in r.stderr and "(64, 128)" in r.stderr, r.stderr[-2000:]
    assert _leftovers(tmp_path, "o") == []


def test_missing_tensor_is_named(llama_dir, tmp_path):
    """Guards against a bare KeyError deep inside the conversion."""
    from safetensors.torch import save_file

    bad = _copy(llama_dir, tmp_path / "bad")
    tensors = read_hf_tensors(bad)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        convert.hf_to_mcore(bad, tmp_path / "out", progress=None)
    assert _leftovers(tmp_path, "out") == []


def test_unknown_family_is_named(llama_dir, tmp_path):
    """Guards against a model family with no mapping table failing obscurely."""
    bad = _copy(llama_dir, tmp_path / "bad")
    _edit_config(bad, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(MappingError, match=r"gpt2.*GPT2LMHeadModel"):
        convert.hf_to_mcore(bad, tmp_path / "out", progress=None)
    assert _leftovers(tmp_path, "out") == []


def test_existing_output_is_not_overwritten(llama_dir, tmp_path):
    """Guards against clobbering a checkpoint by a typo in --out."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(convert.CheckpointError, match="already exists"):
        convert.hf_to_mcore(llama_dir, out, progress=None)
    assert (out / "keep").read_text() == "x"
    with pytest.raises(convert.CheckpointError, match="not a megatron-core distributed checkpoint"):
        convert.mcore_to_hf(llama_dir, tmp_path / "o2", hf_config_dir=llama_dir, progress=None)
