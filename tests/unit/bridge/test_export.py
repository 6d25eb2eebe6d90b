"""``export_hf_weights`` at TP=1 against the HF checkpoint the model was loaded from, and the
trained model written out as an HF directory (``checkpoint.export_hf``) that transformers loads."""
from __future__ import annotations

import json

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
        if family == "qwen2":
            out["hf_dir"] = _export_dir_rank(model, cfg, ps, hf_dir, Path(root) / "run")
    return out


def _export_dir_rank(model, cfg, ps, hf_dir, run):
    """Export the model twice into one directory (the second time with changed weights, as a
    later checkpoint would), load each with transformers, and compare logits with the
    megatron model's at the time of the export."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_mega.bridge import export_hf_weights
    from grpo_mega.checkpoint.export_hf import write_hf_dir
    from grpo_mega.models import forward_logits

    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    res = {}
    for k in range(2):
        if k == 1:
            with torch.no_grad():  # a "trained" model: every weight moved
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        write_hf_dir(export_hf_weights(model, cfg, ps), run / "hf", hf_dir, cfg, step=k, progress=None)
        hf, info = AutoModelForCausalLM.from_pretrained(str(run / "hf"), dtype=torch.float32,
                                                        output_loading_info=True)
        with torch.no_grad():
            ours = forward_logits(model, tokens)[..., :cfg.vocab_size].float()
            theirs = hf.eval()(tokens).logits.float()
        res[k] = dict(diff=float((ours - theirs).abs().max()), scale=float(theirs.abs().max()),
                      missing=sorted(info["missing_keys"]), unexpected=sorted(info["unexpected_keys"]))
    res["listing"] = sorted(p.name for p in run.iterdir())
    res["template"] = (run / "hf" / "chat_template.jinja").read_text() == \
        (hf_dir / "chat_template.jinja").read_text()
    res["step"] = json.loads((run / "hf" / "grpo_mega_export.json").read_text())["step"]
    return res


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
    for family in ("qwen2", "llama"):
        r = exported[family]
        assert r["views"] >= r["tensors"] // 2, (family, r["views"], r["tensors"])


def test_export_hf_dir_loads_in_transformers_with_the_trainers_logits(exported):
    """Guards against an exported HF directory that does not serve the trained model: a
    tensor under a name transformers does not know (loaded as random init with only a
    warning, so checked as missing/unexpected keys), the initial weights written instead of
    the current ones (the second export follows a change of every weight), the tokenizer's
    chat template left behind, or a replaced export leaving its old copy or a temporary
    directory beside it."""
    r = exported["hf_dir"]
    for k in (0, 1):
        assert r[k]["missing"] == [] and r[k]["unexpected"] == [], r[k]
        assert r[k]["diff"] <= 1e-4 * max(1.0, r[k]["scale"]), r[k]
    assert r["listing"] == ["hf"] and r["template"] and r["step"] == 1, r
