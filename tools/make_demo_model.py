#!/usr/bin/env python
"""Build the embedded demo's tokenizer, arithmetic data and warm-started tiny Qwen2
(``--moe``: tiny Qwen3-MoE).

A prebuilt copy ships in grpo_mega/assets/demo_v1; this rebuilds it from
scratch (tokenizer training, random init, supervised warm start) so the
result can be reproduced or changed.
"""
import argparse

from grpo_mega.demo.assets import ensure_demo_assets

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".cache/demo", help="cache directory (default .cache/demo)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if a cached copy exists")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts variant (tiny Qwen3-MoE)")
    args = ap.parse_args()
    ensure_demo_assets(args.out, rebuild=args.rebuild, variant="moe" if args.moe else "dense")
