"""GPU benchmark suite: prints one table and writes it to benchmarks/results/<date>-<device>.md.

Sections (single GPU, TP=1, random-weight Llama-shaped models, no downloads):
  train    actor train step (forward, vocab-parallel GRPO-style log-prob loss, backward,
           AdamW with fp32 master weights): seconds, tokens/s and MFU, for ~1B and ~3B in
           bf16 and, where TE supports them here, each FP8 recipe;
  ref      frozen reference forward (log-probs only): tokens/s;
  loss     log-prob + entropy (+ backward) on bf16 logits [tokens, vocab]: the naive
           full-vocab way vs grpo_mega.algorithms vs the fused Triton kernel; time and
           peak extra memory;
  bridge   weight export through the bridge (HF names, fused QKV / gate-up split): GB/s.
Not in this script: the sync into vLLM and rollout tokens/s through our engine wrapper vs
vLLM alone (benchmarks/bench_weight_sync.py measures the sync on CPU); the results file
says so.

    python benchmarks/gpu.py                          # everything, writes the results file
    python benchmarks/gpu.py --sections loss,bridge --models 1b
    python benchmarks/gpu.py --cpu-smoke              # tiny shapes on CPU: checks the script
                                                      # runs; prints, writes no results file

MFU counts 6 x (matmul parameters) + 6 x layers x seq x (query width) FLOPs per token
(causal attention, forward + backward) against the GPU's dense bf16 peak (FP8 rows: the
FP8 peak). Numbers go into the results file only when measured on a CUDA GPU.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

MODELS = {
    # Llama-3.2-shaped, tied embeddings; "smoke" is for --cpu-smoke only.
    "1b": dict(hidden_size=2048, num_layers=16, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=8192, vocab_size=128256, tie_embeddings=True),
    "3b": dict(hidden_size=3072, num_layers=28, num_attention_heads=24, num_query_groups=8,
               ffn_hidden_size=8192, vocab_size=128256, tie_embeddings=True),
    "smoke": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, vocab_size=512, tie_embeddings=True),
}
# Dense peak TFLOP/s per GPU (bf16, fp8), from the vendors' data sheets; matched by name.
PEAKS = [("H200", 989.0, 1979.0), ("H100 PCIe", 756.0, 1513.0), ("H100", 989.0, 1979.0),
         ("B200", 2250.0, 4500.0), ("A100", 312.0, None), ("L40S", 362.0, 733.0)]
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def peak_tflops(device_name: str, fp8: bool):
    for key, bf16, f8 in PEAKS:
        if key in device_name:
            return f8 if fp8 else bf16
    return None


def train_flops_per_token(m: dict, seq: int) -> float:
    h, layers, f, v = m["hidden_size"], m["num_layers"], m["ffn_hidden_size"], m["vocab_size"]
    hd = h // m["num_attention_heads"]
    q, kv = m["num_attention_heads"] * hd, m["num_query_groups"] * hd
    matmul = layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + h * v
    return 6.0 * matmul + 6.0 * layers * seq * q


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def median(self, fn, repeats: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def peak_extra_mib(self, fn):
        if not self.cuda:
            fn()
            return None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20


def _release():
    """Return freed GPU memory to the device; callers drop their references first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _model_cfg(name: str, dtype: str, fp8: str = "none", recipe: str = "delayed"):
    from grpo_mega.config import ModelConfig
    return ModelConfig(family="llama", dtype=dtype, fp8=fp8, fp8_recipe=recipe,
                       max_position_embeddings=8192, make_vocab_size_divisible_by=128,
                       **MODELS[name])


def _random_batch(vocab_size: int, rows: int, seq: int, device):
    """A TrainingBatch of random tokens: a 1-token prompt and seq-1 response tokens per row."""
    from grpo_mega.trainer.batch import TrainingBatch

    tokens = torch.randint(0, vocab_size, (rows, seq)).tolist()
    return TrainingBatch.pack([r[:1] for r in tokens], [r[1:] for r in tokens],
                              [[0.0] * (seq - 1)] * rows, [0.0] * rows, pad_id=0, device=device)


def _logprob_loss(ps, vocab_size: int, fused: bool):
    from grpo_mega.trainer.batch import _logprobs_entropy

    def loss_fn(logits, mb):
        logp, _ = _logprobs_entropy(logits, mb.targets, ps, vocab_size=vocab_size, temperature=1.0,
                                    fused=fused)
        return -logp.mean(), {}
    return loss_fn


def bench_train(args, ps, timer, rows):
    from grpo_mega.config import OptimizerConfig
    from grpo_mega.algorithms.vocab_parallel_triton import use_fused
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.distributed.schedule import run_microbatches
    from grpo_mega.models.precision import check_fp8_here

    dtype = "bfloat16" if timer.cuda else "float32"
    fused = use_fused("auto", ps.device)
    name_dev = torch.cuda.get_device_name() if timer.cuda else platform.processor() or "cpu"
    for model_name in args.models:
        variants = [("bf16" if timer.cuda else "fp32", "none", "delayed")]
        if timer.cuda:
            variants += [(f"fp8 {r}", "hybrid", r) for r in FP8_RECIPES]
        for label, fp8, recipe in variants:
            row = dict(section="train", case=f"{model_name} {label}", mbs=args.micro_batch, seq=args.seq)
            problem = check_fp8_here(fp8, recipe)
            if problem:
                rows.append(dict(row, note=f"not run: {problem}"))
                continue
            m = _model_cfg(model_name, dtype, fp8, recipe)
            model = opt = None
            try:
                model = build_model(m, ps)
                opt = ParallelAdamW(model, OptimizerConfig(lr=1e-6, clip_grad=1.0), ps)
                micro = [_random_batch(m.vocab_size, args.micro_batch, args.seq, ps.device)]
                loss_fn = _logprob_loss(ps, m.vocab_size, fused)

                def step():
                    opt.zero_grad()
                    run_microbatches(model, micro, loss_fn, ps, forward_only=False)
                    opt.step()

                sec = timer.median(step, args.repeats, warmup=2)
                ntok = args.micro_batch * args.seq
                flops = train_flops_per_token(MODELS[model_name], args.seq) * ntok
                peak = peak_tflops(name_dev, fp8 != "none")
                rows.append(dict(row, seconds=sec, tokens_per_s=ntok / sec,
                                 tflops=flops / sec / 1e12,
                                 mfu=(flops / sec / 1e12 / peak) if peak else None,
                                 note=f"fused loss {'on' if fused else 'off'}"))
            except torch.cuda.OutOfMemoryError as e:  # report, keep going
                rows.append(dict(row, note=f"OOM: {str(e).splitlines()[0][:80]}"))
            finally:
                model = opt = None
                _release()


def bench_ref(args, ps, timer, rows):
    from grpo_mega.trainer.batch import compute_logprobs
    from grpo_mega.algorithms.vocab_parallel_triton import use_fused
    from grpo_mega.models import build_model

    dtype = "bfloat16" if timer.cuda else "float32"
    m = _model_cfg(args.models[0], dtype)
    ref = build_model(m, ps, frozen=True)
    batch = _random_batch(m.vocab_size, args.micro_batch, args.seq, ps.device)
    batch.ref_logp = batch.empty_logp()
    micro = [batch]
    fused = use_fused("auto", ps.device)
    sec = timer.median(lambda: compute_logprobs(ref, micro, ps, vocab_size=m.vocab_size,
                                                temperature=1.0, key="ref_logp", fused=fused),
                       args.repeats)
    rows.append(dict(section="ref", case=f"{args.models[0]} {dtype} forward", mbs=args.micro_batch,
                     seq=args.seq, seconds=sec, tokens_per_s=args.micro_batch * args.seq / sec))
    del ref
    _release()


def bench_loss(args, ps, timer, rows):
    from grpo_mega import algorithms as A
    from grpo_mega.algorithms.vocab_parallel_triton import fused_logprobs_entropy, use_fused

    n, v = args.loss_tokens, args.loss_vocab
    dt = torch.bfloat16 if timer.cuda else torch.float32
    logits = (torch.randn(n, v, device=ps.device) * 2).to(dt).requires_grad_()
    tgt = torch.randint(0, v, (n,), device=ps.device)

    def naive():
        logq = torch.log_softmax(logits.float(), dim=-1)
        lp = logq.gather(-1, tgt[:, None]).squeeze(-1)
        with torch.no_grad():  # entropy is a metric in the update: computed, not differentiated
            _entropy = -(logq.exp() * logq).sum(-1)
        lp.sum().backward()

    def unfused():
        z = logits.float()
        lp = A.vocab_parallel_logprobs(z, tgt)
        with torch.no_grad():
            A.vocab_parallel_entropy(z)
        lp.sum().backward()

    def fused():
        lp, _ = fused_logprobs_entropy(logits, tgt)
        lp.sum().backward()

    ways = [("naive full-vocab", naive), ("grpo_mega.algorithms", unfused)]
    if use_fused("auto", ps.device):
        ways.append(("fused Triton", fused))
    base = None
    for label, fn in ways:
        def run():
            logits.grad = None
            fn()
        sec = timer.median(run, args.repeats)
        mib = timer.peak_extra_mib(run)
        base = base or (sec, mib)
        rows.append(dict(section="loss", case=f"{label} [{n} x {v}] {str(dt)[6:]}", seconds=sec,
                         peak_mib=mib, note=f"{base[0] / sec:.2f}x speed, "
                         + (f"{mib / base[1]:.2f}x memory of naive" if mib and base[1] else "memory n/a")))
    if not use_fused("auto", ps.device):
        rows.append(dict(section="loss", case="fused Triton", note="not run: needs CUDA and Triton"))
    del logits
    _release()


def bench_bridge(args, ps, timer, rows):
    from grpo_mega.bridge import export_buckets
    from grpo_mega.models import build_model

    dtype = "bfloat16" if timer.cuda else "float32"
    m = _model_cfg(args.models[0], dtype)
    model = build_model(m, ps)

    def export():
        total = 0
        for bucket in export_buckets(model, m, ps, bucket_bytes=args.bucket_mb * 2**20):
            total += sum(t.numel() * t.element_size() for _, t in bucket)
        timer.sync()
        return total

    nbytes = export()
    sec = timer.median(export, args.repeats)
    rows.append(dict(section="bridge", case=f"{args.models[0]} {dtype} export, {args.bucket_mb} MiB buckets",
                     seconds=sec, gbps=nbytes / sec / 1e9, note=f"{nbytes / 1e9:.2f} GB"))
    rows.append(dict(section="bridge", case="sync into vLLM / rollout tokens/s",
                     note="not measured by this script (see benchmarks/bench_weight_sync.py on CPU)"))
    del model
    _release()


COLUMNS = [("section", "{}"), ("case", "{}"), ("mbs", "{}"), ("seq", "{}"), ("seconds", "{:.4f}"),
           ("tokens_per_s", "{:,.0f}"), ("tflops", "{:.1f}"), ("mfu", "{:.1%}"), ("gbps", "{:.2f}"),
           ("peak_mib", "{:,.0f}"), ("note", "{}")]


def table(rows) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format(r[c]) if r.get(c) is not None else "" for c, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    for mod in ("megatron.core", "transformer_engine", "triton", "vllm"):
        try:
            pkg = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(pkg, "__version__", "?")
        except Exception:  # noqa: BLE001 - absent (or the CPU meta package of TE)
            out[mod] = "not installed"
    return out


SECTIONS = {"train": bench_train, "ref": bench_ref, "loss": bench_loss, "bridge": bench_bridge}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS))
    ap.add_argument("--models", default="1b,3b", help="comma list of " + ",".join(MODELS))
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--loss-tokens", type=int, default=8192)
    ap.add_argument("--loss-vocab", type=int, default=128256)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU to check the script; writes no results file")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.models, args.micro_batch, args.seq = "smoke", 2, 32
        args.loss_tokens, args.loss_vocab, args.repeats, args.bucket_mb = 64, 1000, 2, 1
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (none here); no results written. "
              "Use --cpu-smoke to check that the script runs.", file=sys.stderr)
        return 2
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in MODELS] + \
              [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown --models/--sections entries {unknown}")

    from grpo_mega.distributed.state import destroy_parallel, init_parallel
    ps = init_parallel(1, 1)
    timer = Timer(ps.device)
    rows = []
    for sec in args.sections.split(","):
        print(f"[gpu-bench] {sec} ...", flush=True)
        SECTIONS[sec](args, ps, timer, rows)
    destroy_parallel()

    device = torch.cuda.get_device_name() if timer.cuda else "CPU smoke (not a GPU figure)"
    command = "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    ver = ", ".join(f"{k} {v}" for k, v in versions().items())
    report = (f"# GPU benchmark, {datetime.date.today()} on {device}\n\n"
              f"Command: `{command.strip()}`\n\nVersions: {ver}\n\n{table(rows)}\n")
    print(report)
    if timer.cuda:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        slug = "".join(ch if ch.isalnum() else "-" for ch in device).strip("-")
        path = out / f"{datetime.date.today()}-{slug}.md"
        path.write_text(report)
        print(f"[gpu-bench] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
