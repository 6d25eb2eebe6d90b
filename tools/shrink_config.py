#!/usr/bin/env python
"""Shrink a scale config to a CPU-sized job with the same parallel pattern.

    python tools/shrink_config.py --config launch/configs/qwen2.5_32b.yaml --out /tmp/shrunk
    CONFIG=launch/configs/qwen2.5_32b.yaml launch/torchrun.sh --shrink   # build it, run it

Why: a scale config (TP8 x PP2 x DP2, engine TP 8, 32 GPUs) cannot run here, but its
pattern can: every parallel axis above 1 (``parallel.tp``, ``parallel.pp``,
``parallel.dp``, ``parallel.ep``) becomes 2 and an axis of 1 stays 1, and the engine's ranks
per replica (``rollout.tp``) keep their ratio to ``parallel.tp`` (an engine spanning several
TP groups spans two), so the job runs at a world of at
most 8 with the same kinds of groups (TP, PP, DP, engine blocks that cross megatron's
replicas; an MoE model gets one engine over the whole world, as vLLM's CPU build needs). The model keeps its family and the config's engine mode, KL and loss settings,
at tiny widths: a random checkpoint (head_dim 32, heads and KV heads divisible by both TPs,
two layers per stage; an MoE model 4 experts, top-2 at most) on the packaged demo tokenizer,
data and exact-match reward, 2 steps.

Writes ``OUT/config.yaml`` and ``OUT/hf/``; prints ``WORLD=<ranks> CONFIG=<file>``.
Overrides after the options apply to the scale config before shrinking.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import yaml

from grpo_mega.config import ConfigError, load_config, rollout_tp, to_dict

DEMO = Path(__file__).resolve().parent.parent / "grpo_mega" / "assets" / "demo_v1"


def shrink_axis(size: int) -> int:
    """An axis above 1 becomes 2, an axis of 1 stays 1."""
    return 2 if size > 1 else 1


def shrink_layout(tp: int, pp: int, dp: int, etp: int, ep: int = 1, moe: bool = False) -> dict[str, int]:
    """The shrunk ``parallel.tp/pp/dp/ep`` and ``rollout.tp`` (engine ranks per replica kept in
    ratio to the trainer's TP, at least 1; an engine of several TP groups spans two) and
    the world they fill. EP is an axis too (it
    lies inside DP, so an EP above 1 needs DP above 1 and both become 2). ``moe``: one
    engine over the whole shrunk world, the only MoE engine layout vLLM's CPU build runs."""
    t, p, d = shrink_axis(tp), shrink_axis(pp), shrink_axis(dp)
    world = t * p * d
    if moe:
        # MoE engine replicas side by side need vLLM's data-parallel MoE dispatch
        # (all_gatherv), which its CPU communicator lacks (start-up refuses that layout)
        e = world
    elif etp >= tp:
        # An engine spanning several trainer TP groups (TP 1, engine TP 8) spans two of them
        e = t * shrink_axis(etp // tp)
    else:  # one inside a TP group keeps its ratio to it
        e = max(1, etp * t // tp)
    if world % e:
        raise ConfigError(f"rollout.tp={etp} at parallel.tp={tp} shrinks to {e}, which does not "
                          f"divide the shrunk world {world}")
    return {"tp": t, "pp": p, "dp": d, "ep": shrink_axis(ep), "rollout_tp": e, "world": world}


def shrink_config_layout(cfg) -> dict[str, int]:
    """``shrink_layout`` of a loaded scale config."""
    return shrink_layout(cfg.parallel.tp, cfg.parallel.pp, max(cfg.parallel.dp, 1), rollout_tp(cfg),
                         cfg.parallel.ep, moe=bool(cfg.model.num_experts))


TINY_EXPERTS = 4
"""Experts per MoE layer of a shrunk MoE model: two per rank at EP 2."""


def tiny_moe(cfg, layout: dict[str, int]) -> dict:
    """A shrunk MoE shape in HF names (empty for a dense model): 4 experts, the config's
    top-k (at most 2 of them), experts 32 x tp wide, the config's top-k renormalisation."""
    if not cfg.model.num_experts:
        return {}
    return {"num_experts": TINY_EXPERTS, "num_experts_per_tok": min(cfg.model.moe_router_topk, 2),
            "moe_intermediate_size": 32 * layout["tp"], "norm_topk_prob": cfg.model.norm_topk_prob}


def tiny_shape(layout: dict[str, int]) -> dict[str, int]:
    """Heads and KV heads divisible by both TPs, head_dim 32 (vLLM's CPU minimum), two
    layers per pipeline stage."""
    k = math.lcm(layout["tp"], layout["rollout_tp"])
    heads, kv = 2 * k, k
    return {"num_heads": heads, "num_kv_heads": kv, "hidden_size": 32 * heads,
            "intermediate_size": 64 * heads, "num_layers": 2 * layout["pp"]}


def shrunk_config(cfg, layout: dict[str, int], hf_dir: Path, run_dir: Path, moe: dict) -> dict:
    """The scale config as a dict, with the shrunk layout, the tiny model and demo data
    (``moe``: the tiny MoE shape, ``tiny_moe``, written here too so that a check of the
    shrunk YAML sees the model the checkpoint holds)."""
    d = to_dict(cfg)
    d["model"].update(hf_checkpoint=str(hf_dir), init_checkpoint=None, dtype="float32", fp8="none",
                      reference_fp8=False, make_vocab_size_divisible_by=2, max_position_embeddings=64)
    if moe:
        d["model"].update(num_experts=moe["num_experts"], moe_router_topk=moe["num_experts_per_tok"],
                          moe_ffn_hidden_size=moe["moe_intermediate_size"])
    d["parallel"].update(tp=layout["tp"], pp=layout["pp"], dp=layout["dp"], ep=layout["ep"],
                         micro_batch_size=2, timeout_minutes=5)
    d["rollout"].update(tp=layout["rollout_tp"], n=4, max_new_tokens=5, max_model_len=32, stop=[])
    engines = layout["world"] // layout["rollout_tp"]
    minis = 2 if cfg.data.mini_batch_size else 1  # each mini-batch's prompts split over DP
    prompts = math.lcm(layout["dp"] * minis, engines, 2)
    d["data"].update(train_path=str(DEMO / "train.jsonl"), eval_path=str(DEMO / "eval.jsonl"),
                     max_prompt_tokens=8, prompts_per_step=prompts,
                     mini_batch_size=prompts * 4 // minis if cfg.data.mini_batch_size else 0,
                     eval_every=0, chat_template=None)
    d["reward"].update(functions=["grpo_mega.demo.assets:exact_match_reward"], weights=[], kwargs={},
                       num_workers=1)
    d["algorithm"].update(steps=2, time_limit_minutes=0.0)
    d["checkpoint"].update(dir=None, save_every=0, offload_reference=False)
    d["logging"].update(run_dir=str(run_dir), tensorboard=False, wandb=False, plot=False)
    return d


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the scale config (YAML)")
    p.add_argument("--out", required=True, help="directory for config.yaml, hf/ and the run")
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        layout = shrink_config_layout(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    moe = tiny_moe(cfg, layout)
    hf = build_tiny_hf_checkpoint(out / "hf", family=cfg.model.family, tokenizer_dir=DEMO / "tokenizer",
                                  tie_word_embeddings=cfg.model.tie_embeddings, seed=0,
                                  max_position_embeddings=64, moe=moe or None, **tiny_shape(layout))
    (out / "config.yaml").write_text(
        f"# {args.config} shrunk by tools/shrink_config.py: world {layout['world']} = tp {layout['tp']} "
        f"x pp {layout['pp']} x dp {layout['dp']} (ep {layout['ep']}), engine replicas of {layout['rollout_tp']} ranks\n"
        + yaml.safe_dump(shrunk_config(cfg, layout, hf, out / "run", moe), sort_keys=False))
    print(f"WORLD={layout['world']} CONFIG={out / 'config.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
