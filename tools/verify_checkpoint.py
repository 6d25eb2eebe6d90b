#!/usr/bin/env python
"""Check that an HF checkpoint and a megatron-core checkpoint hold the same model.

    python tools/verify_checkpoint.py --hf-dir HF_DIR --mcore-dir MCORE_DIR [--tol 1e-4]

Loads the HF side in transformers and the megatron side into a TP=1 GPTModel
(``grpo_mega.checkpoint.convert.load_mcore_weights``; an HF directory also works there, through
``load_hf_weights``), runs both on the same random tokens in float32 and prints the
largest logit difference. Exit status: 0 within --tol, 1 above it, 2 bad input.
"""
from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory")
    p.add_argument("--mcore-dir", required=True, help="megatron-core checkpoint (or HF) directory")
    p.add_argument("--batch", type=int, default=2, help="random sequences")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="token sampling seed")
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed |logit difference|")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grpo_mega.checkpoint import CheckpointError, verify
    from grpo_mega.models.hf import MappingError

    try:
        diff = verify.compare_logits(args.hf_dir, args.mcore_dir, batch=args.batch,
                                      seq_len=args.seq_len, seed=args.seed)
    except (CheckpointError, MappingError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    ok = diff <= args.tol
    print(f"[verify] {'OK' if ok else 'FAIL'}: max difference {diff:.3e} "
          f"{'<=' if ok else '>'} tolerance {args.tol:g}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
