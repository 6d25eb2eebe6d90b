#!/usr/bin/env python
"""Convert a checkpoint between Hugging Face (safetensors) and megatron-core (torch_dist).

    python tools/convert_checkpoint.py hf-to-mcore --hf-dir HF_DIR --out MCORE_DIR
    python tools/convert_checkpoint.py mcore-to-hf --in MCORE_DIR --out HF_DIR [--hf-config DIR]
    python tools/convert_checkpoint.py lora-to-peft --in RUN/checkpoints/step_X --out ADAPTER_DIR [--merged]
    torchrun --nproc-per-node 4 tools/convert_checkpoint.py hf-to-mcore ...   # ranks share the work

The megatron checkpoint holds unsharded canonical tensors; the trainer loads it at
any TP/PP layout (``grpo_mega.checkpoint.convert.load_mcore_weights``). ``lora-to-peft`` turns
a LoRA run's checkpoint (adapters only) into a Hugging Face PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``), or with ``--merged`` into an HF model
with the adapters merged into the base (``grpo_mega.checkpoint.lora_export``). Tensors stream one at a
time; output appears only when complete (temporary directory, then rename). The
logic lives in ``grpo_mega.checkpoint.convert`` and ``grpo_mega.models.hf``; this is the CLI.
Exit status: 0 done, 2 bad input (the message names the tensor / file).
"""
from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron-core torch_dist checkpoint")
    a.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    a.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    a.add_argument("--no-progress", action="store_true",
                   help="a line per tensor instead of a progress bar (a bar is drawn only on a terminal)")
    b = sub.add_parser("mcore-to-hf", help="megatron-core torch_dist checkpoint -> HF safetensors")
    b.add_argument("--in", dest="input", required=True, help="megatron-core checkpoint directory")
    b.add_argument("--out", required=True, help="output HF directory (must not exist unless --overwrite)")
    b.add_argument("--hf-config", default=None,
                   help="HF directory whose config.json / tokenizer to use (needed for checkpoints "
                        "not written by hf-to-mcore)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (GB)")
    b.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    b.add_argument("--allow-unsafe-load", action="store_true",
                   help="unpickle a checkpoint index that names more than torch's checkpoint records; "
                        "this can run code from the files: only for checkpoints you made yourself")
    b.add_argument("--no-progress", action="store_true",
                   help="a line per tensor group instead of a progress bar (drawn only on a terminal)")
    c = sub.add_parser("lora-to-peft", help="LoRA trainer checkpoint -> HF PEFT adapter (or merged HF model)")
    c.add_argument("--in", dest="input", required=True, help="a step_* directory of a LoRA run's checkpoint.dir")
    c.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    c.add_argument("--merged", action="store_true",
                   help="write an HF model with W + scale * B A merged into the base, not the adapter")
    c.add_argument("--base", default=None,
                   help="the HF base model directory (default: the base the checkpoint references)")
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c.add_argument("--allow-unsafe-load", action="store_true",
                   help="unpickle a checkpoint index that names more than torch's checkpoint records; "
                        "this can run code from the files: only for checkpoints you made yourself")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from grpo_mega.checkpoint import CheckpointError, convert
    from grpo_mega.models.hf import MappingError

    try:
        if args.cmd == "lora-to-peft":
            from grpo_mega.checkpoint.lora_export import lora_to_peft
            lora_to_peft(args.input, args.out, merged=args.merged, base_dir=args.base, overwrite=args.overwrite,
                         allow_unsafe_load=args.allow_unsafe_load)
        elif args.cmd == "hf-to-mcore":
            convert.hf_to_mcore(args.hf_dir, args.out, overwrite=args.overwrite, bar=not args.no_progress)
        else:
            convert.mcore_to_hf(args.input, args.out, hf_config_dir=args.hf_config,
                                overwrite=args.overwrite, max_shard_bytes=int(args.max_shard_gb * 2**30),
                                allow_unsafe_load=args.allow_unsafe_load,
                                bar=not args.no_progress)
    except (CheckpointError, MappingError) as e:  # MappingError: MissingTensorError, ShapeMismatchError
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":  # megatron's checkpoint writer re-imports __main__ in a child
    sys.exit(main())
