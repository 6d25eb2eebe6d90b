"""The MoE shape a run builds comes from the checkpoint, and a shrunk MoE scale config
(``tools/shrink_config.py``, ``launch/torchrun.sh --shrink``) is a consistent,
startable config: its YAML, its tiny Qwen3-MoE checkpoint and its layout agree."""
from __future__ import annotations

import json
import sys

import torch.distributed as dist

from tests import REPO

CONFIG_30B = REPO / "launch" / "configs" / "qwen3_30b_a3b.yaml"


def test_moe_shape_is_taken_from_the_checkpoint_not_the_yaml(tmp_path):
    """Guards against ``trainer.preflight`` copying the dense shape from the checkpoint's
    config.json but not the MoE one: a YAML written for Qwen3-30B-A3B (128 experts, top-8,
    width 768) used with another Qwen3-MoE checkpoint (here 4 experts, top-2, width 48,
    no top-k renormalisation) built a model of the YAML's experts, which the weights do not
    load into, and budgeted/validated the wrong model."""
    from grpo_mega.config import load_config
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint
    from grpo_mega.trainer.trainer import preflight

    hf = build_tiny_hf_checkpoint(tmp_path / "hf", family="qwen3_moe", hidden_size=64, num_heads=2,
                                  num_kv_heads=1, tokenizer_dir=REPO / "grpo_mega" / "assets" / "demo_v1" / "tokenizer",
                                  moe={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                       "norm_topk_prob": False})
    assets = REPO / "grpo_mega" / "assets" / "demo_v1"
    cfg = load_config(str(CONFIG_30B), [
        f"--model.hf_checkpoint={hf}", "--parallel.pp=1", "--parallel.dp=1", "--parallel.ep=1",
        "--rollout.tp=1", "--rollout.engine_mode=auto", "--data.prompts_per_step=2", "--data.mini_batch_size=0",
        "--rollout.max_new_tokens=8", "--data.max_prompt_tokens=16", "--rollout.max_model_len=32",
        "--checkpoint.offload_reference=false",
        f"--data.train_path={assets / 'train.jsonl'}", f"--data.eval_path={assets / 'eval.jsonl'}",
        f"--logging.run_dir={tmp_path / 'run'}"])
    preflight(cfg, 1)
    assert not dist.is_initialized()
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.norm_topk_prob) == (4, 2, 48, False)
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups) == (64, 2, 2, 1)


def test_moe_scale_config_shrinks_to_a_consistent_ep_layout(tmp_path):
    """Guards against ``--shrink`` on an MoE config writing a job that cannot start: EP
    dropped (the scale config's expert parallelism never run), an engine of 8 ranks in a
    world of 4 (TP 1 with engine TP 8 kept "in ratio"), or a YAML whose experts are the
    scale model's (128) while the tiny checkpoint has 4. Qwen3-30B-A3B (TP1 x PP2 x DP8,
    EP8, engine TP 8) shrinks to TP1 x PP2 x DP2, EP2, one engine over all 4 ranks (the only
    MoE engine layout vLLM's CPU build runs), and the shrunk YAML passes start-up validation
    at world 4, this machine's checks included."""
    sys.path.insert(0, str(REPO))
    from grpo_mega.config import load_config
    from grpo_mega.models.hf_config import model_config_from_hf
    from grpo_mega.preflight.validate import validate
    from tools import shrink_config

    assert shrink_config.main(["--config", str(CONFIG_30B), "--out", str(tmp_path)]) == 0
    cfg = load_config(str(tmp_path / "config.yaml"))
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.ep, cfg.rollout.tp) == (1, 2, 2, 2, 4)
    hf = model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert hf.family == "qwen3_moe" and hf.num_experts == cfg.model.num_experts == 4
    assert hf.moe_router_topk == cfg.model.moe_router_topk == 2
    assert hf.moe_ffn_hidden_size == cfg.model.moe_ffn_hidden_size
    validate(cfg, 4)
