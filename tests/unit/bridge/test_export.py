"""``export_hf_weights`` at TP=1 against the HF checkpoint the model was loaded from."""
from __future__ import annotations

import pytest

from tests.distributed import run_ranks


def _export_rank(rank, world, root):
    from pathlib import Path

    from safetensors.torch import load_file

    from grpo_mega.bridge import export_hf_weights
    from grpo_mega.checkpoint import convert
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from tests.scripts.bridge_fixtures import write_hf_checkpoint

    out = {}
    for family, tie in (("qwen2", True), ("llama", False)):
        hf_dir = write_hf_checkpoint(Path(root) / family, family, tie=tie)  # vocab 300, padded to 1024
        cfg = convert.read_model_config(hf_dir)
        ps = init_parallel(1, 1)
        model = build_model(cfg, ps)
        convert.load_hf_weights(model, hf_dir, ps, cfg)
        want = load_file(str(hf_dir / "model.safetensors"))
        got = dict(export_hf_weights(model, cfg, ps))
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        out[family] = dict(
            names=sorted(got) == sorted(k for k in want if not (tie and k == "lm_head.weight")),
            shapes={k: (tuple(got[k].shape), tuple(want[k].shape)) for k in got
                    if k in want and got[k].shape != want[k].shape},
            values=[k for k in got if k in want and not (got[k].float() == want[k].float()).all()],
            views=sum(t.untyped_storage().data_ptr() in storages for t in got.values()),
            tensors=len(got))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return run_ranks(1, _export_rank, str(tmp_path_factory.mktemp("export")), timeout=300)[0]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tp1_export_gives_the_hf_tensors_with_their_shapes(exported, family):
    """Guards against the TP=1 export (which takes the parameters as they are, no gather)
    shipping megatron's padded vocabulary rows (1024 rows for a 300-token vocabulary), a
    wrong [gate; up] or QKV split, or a missing/extra name: every tensor must equal the
    checkpoint's, name for name, shape for shape."""
    r = exported[family]
    assert r["names"] and not r["shapes"] and not r["values"], r


def test_tp1_export_hands_over_views_not_copies(exported):
    """Guards against the export copying every parameter at TP=1 (a one-shard gather and
    concatenation: 4.5x the cost of copying the bytes once at 100M parameters): tensors
    that need no reshaping (norms, o_proj, down_proj, embeddings) must share the
    parameters' storage."""
    for family, r in exported.items():
        assert r["views"] >= r["tensors"] // 2, (family, r["views"], r["tensors"])
