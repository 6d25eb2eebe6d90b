"""Benchmark: packed micro-batches against padded ones on a long-tailed batch, side by side.

Layouts of one step's batch (the same rows, the same trainable tokens), timed in one
process, interleaved repeat by repeat (padded, packed, ..., padded, packed, ...) so machine
load falls on all alike; the figure is the median over ``--repeats`` after a warm-up:

  padded    ``parallel.micro_batch_size`` rows per micro-batch, each micro-batch padded to
            its own longest row (``parallel.packing=false``)
  packed    the same rows, run as one THD sequence per micro-batch (``parallel.packing``)
  budget    packed, rows binned under ``parallel.max_tokens_per_micro_batch`` tokens
            (``--budget``; 0 leaves the row out)
  no-pad    the reference of the issue's aim: a batch of the same number of rows and (within
            rounding) the same prompt and response tokens, every row the same length, so
            there is no padding to remove; run padded

Per layout: the reference log-prob pass (``compute_logprobs`` on the frozen reference, the
loop's ``logprobs`` stage), the update (``update_policy``: forward, backward, AdamW step),
the share of computed positions that were padding (``pad_frac``), the activation memory
(the largest micro-batch's bytes saved for backward in the update: distinct storages seen
by ``torch.autograd.graph.saved_tensors_hooks``, the part of the peak that the layout
changes; the weights, gradients and optimizer state are the same for all) and the
reference + update CPU time per trained (response) token (CPU seconds of this one-thread
process: steadier than wall time on a shared machine; the wall time is printed beside).

Lengths are drawn with a fixed seed (``--seed``): prompt tokens lognormal (median
``--prompt-median``, sigma 0.5), response tokens lognormal (median ``--response-median``,
sigma ``--sigma``: 1.0 gives a few responses 5-10x the median), both clipped to
``[4, --max-response]``. ``--chat`` renders each prompt with a ChatML template
(system + user turn + assistant header; the template of an instruct model) around the
drawn user text, as the 100M run below does.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py                    # small model, ~1 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py --shape 100m --chat \\
        --samples 16 --micro 4 --budget 1024 --repeats 2                              # ~100M params
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py --smoke            # seconds

Not a test: numbers depend on the machine and its load. TP=1, CPU, float32.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # ModelConfig fields (llama-style: RMSNorm, SwiGLU, RoPE, GQA)
    "small": dict(vocab_size=8192, hidden_size=256, num_layers=4, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=704),
    "100m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_attention_heads=12,
                 num_query_groups=4, ffn_hidden_size=2048),
    "smoke": dict(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=128),
}
# The token ids of a ChatML header, standing for the template's special pieces: any ids do
# for timing, what matters is that every prompt carries the same fixed-length frame.
_CHAT_FRAME = {"system": [1, 10, 11, 12, 13, 14, 15, 16, 17, 2, 5], "user": [1, 20, 5],
               "end": [2, 5], "assistant": [1, 30, 5]}


def draw_lengths(n: int, rng: random.Random, *, prompt_median: float, response_median: float,
                 sigma: float, max_response: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths): lognormal, clipped to [4, max_response]."""
    def ln(median: float, s: float) -> int:
        return max(4, min(max_response, round(math.exp(rng.gauss(math.log(median), s)))))
    return ([ln(prompt_median, 0.5) for _ in range(n)], [ln(response_median, sigma) for _ in range(n)])


def make_rows(plens: list[int], rlens: list[int], vocab: int, rng: random.Random, chat: bool):
    """Token lists for the drawn lengths; ``chat``: the prompt is a ChatML frame around a user
    text of the drawn length."""
    frame = (_CHAT_FRAME["system"] + _CHAT_FRAME["end"] + _CHAT_FRAME["user"]) if chat else []
    tail = (_CHAT_FRAME["end"] + _CHAT_FRAME["assistant"]) if chat else []
    prompts = [frame + [rng.randrange(40, vocab) for _ in range(p)] + tail for p in plens]
    responses = [[rng.randrange(40, vocab) for _ in range(r)] for r in rlens]
    return prompts, responses


def no_pad_rows(prompts, responses, vocab: int, rng: random.Random):
    """Rows of one length carrying (within rounding) the same prompt and response tokens."""
    n = len(prompts)
    p = round(sum(map(len, prompts)) / n)
    r = round(sum(map(len, responses)) / n)
    return ([[rng.randrange(40, vocab) for _ in range(p)] for _ in range(n)],
            [[rng.randrange(40, vocab) for _ in range(r)] for _ in range(n)])


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while active."""

    def __init__(self):
        import torch
        self.seen: dict[int, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t):
        st = t.untyped_storage()
        self.seen[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--samples", type=int, default=32, help="rows of the step (prompts x samples)")
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch (parallel.micro_batch_size)")
    ap.add_argument("--budget", type=int, default=1024,
                    help="parallel.max_tokens_per_micro_batch of the 'budget' row (0: no such row)")
    ap.add_argument("--prompt-median", type=float, default=32)
    ap.add_argument("--response-median", type=float, default=48)
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of response lengths")
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--chat", action="store_true", help="ChatML-framed prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny model and batch, one repeat (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.samples, args.micro, args.budget, args.repeats = "smoke", 8, 4, 192, 1
        args.prompt_median, args.response_median, args.max_response = 8, 12, 64

    import torch

    from grpo_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    ps = init_parallel(1, 1, seed=0)
    cfg = ModelConfig(**SHAPES[args.shape], make_vocab_size_divisible_by=128)
    model = build_model(cfg, ps)
    ref = build_model(cfg, ps, frozen=True)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-7), ps)
    params = sum(p.numel() for p in model.parameters())
    algo = AlgorithmConfig(kl_coef=0.005, kl_kind="k3")
    rng = random.Random(args.seed)
    plens, rlens = draw_lengths(args.samples, rng, prompt_median=args.prompt_median,
                                response_median=args.response_median, sigma=args.sigma,
                                max_response=args.max_response)
    prompts, responses = make_rows(plens, rlens, cfg.vocab_size, rng, args.chat)
    flat_p, flat_r = no_pad_rows(prompts, responses, cfg.vocab_size, rng)
    adv = [rng.gauss(0, 1) for _ in range(args.samples)]
    longest = max(map(len, responses))
    kw = dict(vocab_size=cfg.vocab_size, temperature=1.0)
    layouts = {"padded": (prompts, responses, False, 0), "packed": (prompts, responses, True, 0)}
    if args.budget:
        layouts["budget"] = (prompts, responses, True, args.budget)
    layouts["no-pad"] = (flat_p, flat_r, False, 0)

    def step(name: str, measure: bool) -> dict:
        p, r, packing, budget = layouts[name]
        b = TrainingBatch.pack(p, r, [[-1.0] * len(x) for x in r], adv, pad_id=0, device=ps.device,
                               packing=packing)
        b, sizes, _ = plan_micro_batches(b, len(b), args.micro, max_tokens=budget, device=ps.device)
        b.ref_logp = b.empty_logp()
        micro = cut(b, sizes)[0]
        t0, c0 = time.perf_counter(), time.process_time()
        compute_logprobs(ref, micro, ps, key="ref_logp", **kw)
        t1, c1 = time.perf_counter(), time.process_time()
        saved: list[SavedBytes] = []
        if measure:
            _update_measured(model, opt, micro, ps, algo, longest, kw, saved)
        else:
            update_policy(model, opt, micro, ps, algo, max_len=longest, reuse_current_as_old=True, **kw)
        t2, c2 = time.perf_counter(), time.process_time()
        positions = sum(mb.computed_positions for mb in micro)
        return dict(ref=c1 - c0, update=c2 - c1, wall=t2 - t0, positions=positions, tokens=b.num_tokens,
                    trained=int(b.loss_mask.sum()), micro=len(micro),
                    act=max((s.total for s in saved), default=0))

    times: dict[str, list[dict]] = {k: [] for k in layouts}
    for i in range(args.repeats + 1):
        for name in (list(layouts) if i % 2 else list(layouts)[::-1]):
            # The warm-up pass counts saved bytes (its entry gives the memory column only);
            # the timed passes run bare.
            times[name].append(step(name, measure=i == 0))
    rows = {}
    for name, rs in times.items():
        timed = rs[1:]
        rows[name] = dict(ref=statistics.median(r["ref"] for r in timed),
                          update=statistics.median(r["update"] for r in timed),
                          wall=statistics.median(r["wall"] for r in timed),
                          act=rs[0]["act"], positions=rs[0]["positions"], tokens=rs[0]["tokens"],
                          trained=rs[0]["trained"], micro=rs[0]["micro"])
        r = rows[name]
        r["pad_frac"] = 1 - r["tokens"] / r["positions"]
        r["per_token_us"] = 1e6 * (r["ref"] + r["update"]) / r["trained"]
    load = os.getloadavg()[0]
    print(f"model {args.shape}: {params / 1e6:.1f}M params; {args.samples} rows, prompts lognormal "
          f"median {args.prompt_median:g} sigma 0.5{' + ChatML frame' if args.chat else ''}, responses "
          f"lognormal median {args.response_median:g} sigma {args.sigma:g} clipped to [4, {args.max_response}] "
          f"(seed {args.seed}): response tokens min {min(rlens)} median {statistics.median(rlens):g} "
          f"max {max(rlens)}; {args.micro} rows per micro-batch; median of {args.repeats} "
          f"(interleaved); ref / update / per-token figures are CPU seconds of this one-thread process "
          f"(steadier than wall time on a shared machine; 'wall s' is ref + update wall); "
          f"load average {load:.1f}")
    head = (f"{'layout':<8}{'micro':>6}{'tokens':>8}{'positions':>10}{'pad_frac':>9}{'ref s':>8}"
            f"{'update s':>9}{'wall s':>8}{'act MiB':>9}{'us/trained tok':>15}{'x no-pad':>9}")
    print(head)
    base = rows["no-pad"]["per_token_us"]
    for name, r in rows.items():
        print(f"{name:<8}{r['micro']:>6}{r['tokens']:>8}{r['positions']:>10}{r['pad_frac']:>9.3f}"
              f"{r['ref']:>8.3f}{r['update']:>9.3f}{r['wall']:>8.3f}{r['act'] / 2**20:>9.1f}{r['per_token_us']:>15.1f}"
              f"{r['per_token_us'] / base:>9.2f}")
    p, q = rows["padded"], rows["packed"]
    print(f"packed / padded: reference pass {q['ref'] / p['ref']:.2f}x, update {q['update'] / p['update']:.2f}x, "
          f"activations {q['act'] / max(p['act'], 1):.2f}x, time per trained token "
          f"{q['per_token_us'] / p['per_token_us']:.2f}x; packed / no-pad {q['per_token_us'] / base:.2f}x "
          f"(aim: within 1.15x)")
    return rows



def _update_measured(model, opt, micro, ps, algo, longest, kw, saved: list):
    """``update_policy`` with each micro-batch's saved activations counted (a ``SavedBytes``
    per policy forward, appended to ``saved``, entered through the schedule's
    ``around_forward`` hook point)."""
    from grpo_mega.distributed import schedule
    from grpo_mega.trainer import passes

    real = schedule.run_microbatches

    def counted(model_, micro_, loss_fn, ps_, **k):
        prev = k.pop("around_forward", None)

        def around(mb):
            import contextlib
            stack = contextlib.ExitStack()
            if prev is not None:
                stack.enter_context(prev(mb))
            saved.append(stack.enter_context(SavedBytes()))
            return stack
        return real(model_, micro_, loss_fn, ps_, around_forward=around, **k)

    passes.run_microbatches = counted
    try:
        return passes.update_policy(model, opt, micro, ps, algo, max_len=longest,
                                    reuse_current_as_old=True, **kw)
    finally:
        passes.run_microbatches = real


if __name__ == "__main__":
    main()
