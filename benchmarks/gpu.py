"""GPU benchmark suite: prints one table and writes it, row by row as measured, to
benchmarks/results/<date>-<device>-bench.md (a failing row records its error; the rest run).

Sections (single GPU, TP=1, random-weight Llama-shaped models, no downloads):
  train    actor train step (forward, vocab-parallel GRPO-style log-prob loss, backward,
           AdamW with fp32 master weights): seconds, tokens/s and MFU, for ~1B and ~3B in
           bf16 and, where TE supports them here, each FP8 recipe;
  ref      frozen reference forward (log-probs only): tokens/s;
  loss     log-prob + entropy (+ backward) on bf16 logits [tokens, vocab]: the naive
           full-vocab way vs grpo_mega.algorithms vs the fused Triton kernel; time and
           peak extra memory;
  bridge   weight export through the bridge (HF names, fused QKV / gate-up split), each
           tensor copied into a preallocated one on the GPU as the engine's load does: GB/s.
Each row also records its peak GPU memory (``peak_gib``: torch's peak allocation during the
row) next to what the project's memory budget (``python -m grpo_mega.preflight.budget``, whose
command and report head the results file) predicts for the same shape (``budget_gib``:
train = weights + fp32 grads + optimizer + activations + logits; ref = weights + logits;
bridge = weights + their exported copy). Train and ref notes name the layer spec ("local
spec, no TE" when Transformer Engine does not import). Not in this script: the sync into vLLM and rollout tokens/s through our engine wrapper vs
vLLM alone (benchmarks/bench_weight_sync.py measures the sync on CPU); the results file
says so.

    python benchmarks/gpu.py                          # everything, writes the results file
    python benchmarks/gpu.py --sections loss,bridge --models 1b
    python benchmarks/gpu.py --cpu-smoke              # tiny shapes on CPU: checks the script
                                                      # runs; prints, writes no results file
    python benchmarks/gpu.py --versions               # card, driver, torch, CUDA, megatron...;
                                                      # exit 1 without a GPU or megatron-core

MFU counts 6 x (matmul parameters) + 6 x layers x seq x (query width) FLOPs per token
(causal attention, forward + backward) against the GPU's dense bf16 peak. FP8 rows: against
the peak of their mix (the layers' GEMMs at the FP8 peak, attention and the LM head at bf16;
``mixed_peak``). The 3B rows run 1 sequence per micro-batch with full recompute (TRAIN_FIT).
Numbers go into the results file only when measured on a CUDA GPU.
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

from benchmarks.gpu_budget import budget_gib, budget_text  # noqa: E402

MODELS = {
    # Llama-3.2-shaped, tied embeddings; "smoke" is for --cpu-smoke only.
    "1b": dict(hidden_size=2048, num_layers=16, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=8192, vocab_size=128256, tie_embeddings=True),
    "3b": dict(hidden_size=3072, num_layers=28, num_attention_heads=24, num_query_groups=8,
               ffn_hidden_size=8192, vocab_size=128256, tie_embeddings=True),
    "smoke": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, vocab_size=512, tie_embeddings=True),
}
# Per-model train settings that fit one 80 GB GPU: 3B holds 18 B/param of weights, fp32
# grads and Adam state (58 GB) before activations and the [tokens, 128k] logits, so it runs
# one sequence per micro-batch with full recompute (4 x 2048 tokens OOMed).
TRAIN_FIT = {"3b": dict(micro_batch=1, recompute="full")}
# Without Transformer Engine megatron's local attention is unfused, and the budget does not
# count what it keeps for the backward: per layer the [mbs, heads, s, s] softmax output in
# fp32 (attention_softmax_in_fp32, megatron's default) and its bf16 copy, 6 B per score.
# 1B at 4 x 2048: 16 x 4 x 32 x 2048^2 x 6 B = 48 GiB over the budget's 43.8 GiB train rows,
# ~92 GiB: out of memory on 80 GB. At micro-batch 1: 12 GiB over 26.5 GiB, ~38.5 GiB, fits.
# (3B recomputes every layer, so one layer's scores at a time.)
TRAIN_FIT_LOCAL = {**TRAIN_FIT, "1b": dict(micro_batch=1)}
LOCAL_SCORE_BYTES = 6


def local_attention_gib(shape: dict, mbs: int, seq: int) -> float:
    """GiB the local (no TE) attention keeps for the backward over all layers (see above)."""
    scores = mbs * shape["num_attention_heads"] * seq * seq
    return shape["num_layers"] * scores * LOCAL_SCORE_BYTES / 2**30


def train_fit(model_name: str, te: bool) -> dict:
    """The train row's settings that fit one 80 GB GPU, with or without TE's fused attention."""
    return (TRAIN_FIT if te else TRAIN_FIT_LOCAL).get(model_name, {})
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


def train_flops_split(m: dict, seq: int) -> tuple[float, float]:
    """(FLOPs per token in the layers' linear GEMMs, the rest): with FP8 only the first
    part runs in FP8; attention scores and the LM head stay bf16."""
    h, layers, f, v = m["hidden_size"], m["num_layers"], m["ffn_hidden_size"], m["vocab_size"]
    hd = h // m["num_attention_heads"]
    q, kv = m["num_attention_heads"] * hd, m["num_query_groups"] * hd
    linear = 6.0 * layers * (h * (q + 2 * kv) + q * h + 3 * h * f)
    return linear, 6.0 * h * v + 6.0 * layers * seq * q


def mixed_peak(m: dict, seq: int, bf16_peak: float, fp8_peak: float) -> float:
    """The peak an FP8 row can reach: its FP8 GEMMs at the FP8 peak and the rest at the
    bf16 peak (dividing everything by the FP8 peak understated MFU; by bf16, overstated)."""
    fp8_part, bf16_part = train_flops_split(m, seq)
    return (fp8_part + bf16_part) / (fp8_part / fp8_peak + bf16_part / bf16_peak)


class Report:
    """Rows as measured: each is printed and the results file rewritten at once, so a crash
    (a TE or NCCL error, a hang killed by the smoke script's timeout) keeps every row
    measured before it. ``measure`` records any exception in the row's note and goes on."""

    def __init__(self, header: str, path: "Path | None"):
        self.header, self.path, self.rows = header, path, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print("[gpu-bench] " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.text())

    def measure(self, row: dict, fn) -> None:
        cuda = torch.cuda.is_available()
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            row = dict(row, **fn())
            if cuda:
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except torch.cuda.OutOfMemoryError as e:
            row = dict(row, note=f"OOM: {str(e).splitlines()[0][:120]}")
        except Exception as e:  # noqa: BLE001 - any failure is a result; the next row runs
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            row = dict(row, note=f"error: {type(e).__name__}: {msg}")
        finally:
            _release()
        self.add(row)

    def text(self) -> str:
        return f"{self.header}{table(self.rows)}\n"


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


def _spec_label(device) -> str:
    from grpo_mega.models.precision import choose_te
    return "TE spec" if choose_te(device.type, "auto") else "local spec, no TE"


def _random_batch(vocab_size: int, rows: int, seq: int, device):
    """A TrainingBatch of random tokens: a 1-token prompt and seq-1 response tokens per row."""
    from grpo_mega.trainer.batch import TrainingBatch

    tokens = torch.randint(0, vocab_size, (rows, seq)).tolist()
    return TrainingBatch.pack([r[:1] for r in tokens], [r[1:] for r in tokens],
                              [[0.0] * (seq - 1)] * rows, [0.0] * rows, pad_id=0, device=device)


def _logprob_loss(ps, vocab_size: int, fused: bool):
    from grpo_mega.trainer.passes import _logprobs_entropy

    def loss_fn(logits, mb):
        # run_microbatches without logits_at: the full [b, s, V/tp] shard (every position)
        logp, _ = _logprobs_entropy(logits, mb, ps, vocab_size=vocab_size, temperature=1.0,
                                    fused=fused, all_positions=True)
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
    spec = _spec_label(ps.device)
    for model_name in args.models:
        variants = [("bf16" if timer.cuda else "fp32", "none", "delayed")]
        if timer.cuda:
            variants += [(f"fp8 {r}", "hybrid", r) for r in FP8_RECIPES]
        fit = train_fit(model_name, te=spec == "TE spec")
        mbs = fit.get("micro_batch", args.micro_batch)
        for label, fp8, recipe in variants:
            row = dict(section="train", case=f"{model_name} {label}"
                       + (f", recompute {fit['recompute']}" if "recompute" in fit else ""), mbs=mbs, seq=args.seq)
            if fp8 == "none":
                row["budget_gib"] = budget_gib(MODELS[model_name], dtype, mbs, args.seq,
                                               fit.get("recompute", "none")).get("train")
            problem = check_fp8_here(fp8, recipe)
            if problem:
                rows.add(dict(row, note=f"not run: {problem}"))
                continue

            def run(model_name=model_name, fp8=fp8, recipe=recipe):
                m = _model_cfg(model_name, dtype, fp8, recipe)
                if "recompute" in fit:
                    m.recompute = fit["recompute"]
                model = build_model(m, ps)
                opt = ParallelAdamW(model, OptimizerConfig(lr=1e-6, clip_grad=1.0), ps)
                micro = [_random_batch(m.vocab_size, mbs, args.seq, ps.device)]
                loss_fn = _logprob_loss(ps, m.vocab_size, fused)

                def step():
                    opt.zero_grad()
                    run_microbatches(model, micro, loss_fn, ps, forward_only=False)
                    opt.step()

                sec = timer.median(step, args.repeats, warmup=2)
                ntok = mbs * args.seq
                shape = MODELS[model_name]
                flops = train_flops_per_token(shape, args.seq) * ntok
                bf16_peak, fp8_peak = peak_tflops(name_dev, False), peak_tflops(name_dev, True)
                peak, basis = bf16_peak, "bf16 peak"
                if fp8 != "none" and bf16_peak and fp8_peak:
                    peak, basis = mixed_peak(shape, args.seq, bf16_peak, fp8_peak), "FP8 GEMMs + bf16 rest peak"
                return dict(seconds=sec, tokens_per_s=ntok / sec, tflops=flops / sec / 1e12,
                            mfu=(flops / sec / 1e12 / peak) if peak else None,
                            note=f"{spec}; fused loss {'on' if fused else 'off'}; MFU vs {basis}")

            rows.measure(row, run)


def bench_ref(args, ps, timer, rows):
    from grpo_mega.trainer.passes import compute_logprobs
    from grpo_mega.algorithms.vocab_parallel_triton import use_fused
    from grpo_mega.models import build_model

    dtype = "bfloat16" if timer.cuda else "float32"

    def run():
        m = _model_cfg(args.models[0], dtype)
        ref = build_model(m, ps, frozen=True)
        batch = _random_batch(m.vocab_size, args.micro_batch, args.seq, ps.device)
        batch.ref_logp = batch.empty_logp()
        fused = use_fused("auto", ps.device)
        sec = timer.median(lambda: compute_logprobs(ref, [batch], ps, vocab_size=m.vocab_size,
                                                    temperature=1.0, key="ref_logp", fused=fused),
                           args.repeats)
        return dict(seconds=sec, tokens_per_s=args.micro_batch * args.seq / sec, note=_spec_label(ps.device))

    rows.measure(dict(section="ref", case=f"{args.models[0]} {dtype} forward", mbs=args.micro_batch, seq=args.seq,
                      budget_gib=budget_gib(MODELS[args.models[0]], dtype, args.micro_batch, args.seq).get("ref")), run)


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
    base = []
    for label, fn in ways:
        def measure(fn=fn):
            def run():
                logits.grad = None
                fn()
            sec = timer.median(run, args.repeats)
            mib = timer.peak_extra_mib(run)
            base.append((sec, mib)) if not base else None
            return dict(seconds=sec, peak_mib=mib, note=f"{base[0][0] / sec:.2f}x speed, "
                        + (f"{mib / base[0][1]:.2f}x memory of naive" if mib and base[0][1] else "memory n/a"))
        rows.measure(dict(section="loss", case=f"{label} [{n} x {v}] {str(dt)[6:]}"), measure)
    if not use_fused("auto", ps.device):
        rows.add(dict(section="loss", case="fused Triton", note="not run: needs CUDA and Triton"))
    del logits
    _release()


def bench_bridge(args, ps, timer, rows):
    from grpo_mega.bridge import export_buckets
    from grpo_mega.models import build_model

    dtype = "bfloat16" if timer.cuda else "float32"

    def run():
        m = _model_cfg(args.models[0], dtype)
        model = build_model(m, ps)
        # At TP=1 the export yields views of the parameters (no bytes move), so timing it
        # alone measured nothing: every tensor is copied into a preallocated tensor on the
        # device, as the engine's in-place load does.
        dst: dict = {}

        def export():
            total = 0
            for bucket in export_buckets(model, m, ps, bucket_bytes=args.bucket_mb * 2**20):
                for name, t in bucket:
                    if name not in dst:
                        dst[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
                    dst[name].copy_(t)
                    total += t.numel() * t.element_size()
            timer.sync()
            return total

        nbytes = export()
        sec = timer.median(export, args.repeats)
        return dict(seconds=sec, gbps=nbytes / sec / 1e9, note=f"{nbytes / 1e9:.2f} GB exported and copied")

    rows.measure(dict(section="bridge", case=f"{args.models[0]} {dtype} export + copy, {args.bucket_mb} MiB buckets",
                      budget_gib=budget_gib(MODELS[args.models[0]], dtype, args.micro_batch, args.seq).get("bridge")), run)
    rows.add(dict(section="bridge", case="sync into vLLM / rollout tokens/s",
                  note="not measured by this script (tools/gpu_smoke.sh syncs into a vLLM GPU engine)"))


COLUMNS = [("section", "{}"), ("case", "{}"), ("mbs", "{}"), ("seq", "{}"), ("seconds", "{:.4f}"),
           ("tokens_per_s", "{:,.0f}"), ("tflops", "{:.1f}"), ("mfu", "{:.1%}"), ("gbps", "{:.2f}"),
           ("peak_mib", "{:,.0f}"), ("peak_gib", "{:.2f}"), ("budget_gib", "{:.2f}"), ("note", "{}")]


def table(rows) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format(r[c]) if r.get(c) is not None else "" for c, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versions() -> dict:
    import subprocess
    try:  # the driver's version is nvidia-smi's (torch knows only the CUDA API level)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        smi = "no nvidia-smi"
    out = {"card, driver, memory": smi, "python": platform.python_version(), "torch": torch.__version__,
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
    ap.add_argument("--versions", action="store_true",
                    help="print the card, driver and package versions; exit 1 without a GPU or megatron-core")
    args = ap.parse_args(argv)
    if args.versions:
        ver = versions()
        print("\n".join(f"{k}: {v}" for k, v in ver.items()))
        return 0 if torch.cuda.is_available() and ver["megatron.core"] != "not installed" else 1
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
    device = torch.cuda.get_device_name() if timer.cuda else "CPU smoke (not a GPU figure)"
    command = "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    ver = ", ".join(f"{k} {v}" for k, v in versions().items())
    header = (f"# GPU benchmark, {datetime.date.today()} on {device}\n\n"
              f"Command: `{command.strip()}`\n\nVersions: {ver}\n\n"
              + budget_text(args.models[0], MODELS[args.models[0]], args.micro_batch, args.seq, timer.cuda))
    path = None
    if timer.cuda:
        slug = "".join(ch if ch.isalnum() else "-" for ch in device).strip("-")
        path = Path(args.out_dir) / f"{datetime.date.today()}-{slug}-bench.md"
    rows = Report(header, path)
    for sec in args.sections.split(","):
        print(f"[gpu-bench] {sec} ...", flush=True)
        try:
            SECTIONS[sec](args, ps, timer, rows)
        except Exception as e:  # noqa: BLE001 - a section's set-up failed; the others run
            rows.add(dict(section=sec, case="(set-up)", note=f"error: {type(e).__name__}: {e}"[:200]))
    destroy_parallel()
    print(rows.text())
    if path is not None:
        print(f"[gpu-bench] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
