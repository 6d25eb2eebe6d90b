"""Benchmark: peak memory and time of one update on a long episode with few trainable tokens,
the output layer at every position (the path before) against only the trainable ones.

What it measures
    One GRPO update (``update_policy``: forward, loss, backward, AdamW step) of a tiny
    megatron GPTModel (TP=1, bf16, one layer, hidden 64) on one episode of ``--tokens``
    tokens of which ``--trainable`` are the model's, in ``--turns`` turns spread over the
    episode (tool output between them, the last turn at the end), at a vocabulary of
    ``--vocab``. Per variant and length, in a FRESH child process (one at a time, so each
    high-water mark is one variant's alone), from VmHWM (reset through ``clear_refs``):
      update peak   the peak RSS of the whole update minus the RSS before it (model, batch
                    and optimizer built);
      logits peak   the peak from the moment the output layer is called (a forward
                    pre-hook: the decoder's activations are alive and not counted) to the
                    moment the gradient reaches its input hidden states (a tensor hook):
                    the output layer, the logits, log-probs, entropy and their backward;
      update s      the wall time of the second of two updates (the first warms up).
    On this CPU the decoder's attention materialises ``[s, s]`` scores (the local layer
    spec), so at 16k tokens the update's peak is the attention's backward in both variants;
    with flash attention (GPU, TE) the logits are the largest part.

Variants
    all        ``all_positions=True`` (the path before): logits ``[tokens, V]`` and their gradient.
    trainable  the default: logits ``[K, V]`` at the K trainable positions only.

Run (the ``all`` variant at 16k tokens x 128k vocab needs about 12 GB of RAM; 4 minutes):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainable_logits.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainable_logits.py --lengths 2048 --vocab 32000 --trainable 256
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

VARIANTS = ("all", "trainable")


def _high_water_mark() -> int:
    """Peak RSS in bytes since the last reset (VmHWM; ``clear_refs`` 5 resets it, Linux >= 4.0)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def episode_mask(tokens: int, trainable: int, turns: int):
    """[1, tokens-1] bool: ``turns`` runs of model tokens, evenly spaced, the last one ending
    the episode; everything before and between them is prompt or tool output."""
    import torch

    mask = torch.zeros(1, tokens - 1, dtype=torch.bool)
    per, gap = trainable // turns, (tokens - 1) // turns
    for k in range(turns):
        end = (k + 1) * gap if k < turns - 1 else tokens - 1
        n = per if k < turns - 1 else trainable - per * (turns - 1)
        mask[0, end - n:end] = True
    return mask


def _work(variant: str, tokens: int, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import psutil
    import torch

    from grpo_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.passes import update_policy

    ps = init_parallel(1, 1, seed=0)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=1, num_attention_heads=2,
                      num_query_groups=1, ffn_hidden_size=2 * args.hidden, dtype=args.dtype,
                      max_position_embeddings=tokens)
    model = build_model(cfg, ps)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-7), ps)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, tokens), generator=g)
    mask = episode_mask(tokens, args.trainable, args.turns)
    batch = TrainingBatch(tokens=ids, targets=ids[:, 1:], loss_mask=mask, advantages=torch.ones(1),
                          rollout_logp=torch.zeros(1, tokens - 1), seq_lens=[tokens])
    algo = AlgorithmConfig(kl_coef=0.0)
    kw = dict(vocab_size=args.vocab, temperature=args.temperature, max_len=args.trainable,
              reuse_current_as_old=True, chunk_size=args.chunk_size, all_positions=variant == "all")
    rss = psutil.Process().memory_info
    marks = {"peak": 0}

    def at_output_layer(module, inputs):
        # registered before the update's own hook, so it sees the whole [s, b, h] input
        marks["peak"] = max(marks["peak"], _high_water_mark())
        _reset_high_water_mark()
        marks["head_start"] = rss().rss
        if inputs[0].requires_grad:
            inputs[0].register_hook(lambda grad: marks.__setitem__("head_peak", _high_water_mark()))

    model.output_layer.register_forward_pre_hook(at_output_layer)
    _reset_high_water_mark()
    rss_before = rss().rss
    times = []
    for _ in range(2):  # a warm-up (Adam's state is made there), then the timed update
        t0 = time.perf_counter()
        update_policy(model, opt, [batch], ps, algo, **kw)
        times.append(time.perf_counter() - t0)
    peak = max(marks["peak"], _high_water_mark())
    queue.put(dict(extra=peak - rss_before, logits=marks["head_peak"] - marks["head_start"],
                   time=times[-1], rows=tokens if variant == "all" else int(mask.sum())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384", help="episode lengths in tokens, comma-separated")
    ap.add_argument("--trainable", type=int, default=1024, help="the model's tokens in an episode")
    ap.add_argument("--turns", type=int, default=8, help="model turns the trainable tokens come in")
    ap.add_argument("--vocab", type=int, default=128256, help="real vocabulary (padded to a multiple of 1024)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=1024, help="algorithm.logits_chunk_size")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dry-run", action="store_true", help="print the settings and exit")
    args = ap.parse_args()
    print(f"settings: {vars(args)}")
    if args.dry_run:
        return
    ctx = mp.get_context("spawn")
    rows = {}
    for tokens in (int(x) for x in args.lengths.split(",")):
        for v in args.variants.split(","):
            queue = ctx.SimpleQueue()
            p = ctx.Process(target=_work, args=(v, tokens, args, queue))
            p.start()
            p.join()
            if p.exitcode:
                raise SystemExit(f"{v} at {tokens} tokens: the child failed (exit code {p.exitcode})")
            rows[tokens, v] = queue.get()
    gib = 2 ** 30
    print(f"one update, TP=1, {args.dtype}, vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.trainable} trainable tokens in {args.turns} turns, chunk {args.chunk_size}")
    print("| tokens | variant | rows at the output layer | update peak GiB | logits peak GiB | update s |"
          " vs all: update peak, logits peak, time |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for (tokens, v), r in rows.items():
        base = rows.get((tokens, "all"))
        ratio = (f"{r['extra'] / base['extra']:.2f}x, {r['logits'] / base['logits']:.3f}x, "
                 f"{r['time'] / base['time']:.2f}x" if base and v != "all" else "")
        print(f"| {tokens} | {v} | {r['rows']} | {r['extra'] / gib:.2f} | {r['logits'] / gib:.3f} | "
              f"{r['time']:.2f} | {ratio} |")

if __name__ == "__main__":
    main()
