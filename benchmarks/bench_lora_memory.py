"""Benchmark: full fine-tuning vs LoRA at one shape, side by side: memory, step time, sync bytes, learning.

Each mode runs in its own child process (so its peak RSS is its own), one after the other:
  full   the model trains every parameter (``ParallelAdamW`` over all of them); the KL
         reference is a second, frozen model (``build_model(..., frozen=True)``), as the trainer
         builds it when ``model.lora`` is null
  lora   the same model with ``grpo_mega.lora.attach_lora`` (rank --rank on qkv, proj, fc1, fc2):
         the base frozen, the optimizer over the adapters only, the reference
         ``lora.ReferenceView`` (the actor with adapters off), as ``trainer.build_trainer`` does
One step = the reference log-prob pass (``compute_logprobs``) + the update (``update_policy``:
forward, backward, AdamW step) on the same fixed batch (--samples rows of --prompt + --response
tokens). Per mode: the state a step holds (weights, the reference's, fp32 gradients of the
trainable parameters from the backward to the step, Adam moments: bytes, exact), the process's peak RSS (``ru_maxrss``, everything:
Python, torch, megatron imports, activations), the median update and reference CPU seconds
of --repeats steps after a warm-up (this one-thread process: steadier than wall time on a
shared machine), and the bytes a weight sync ships: every weight (full, and LoRA ``merged``:
W + scale B A in the same names) or the adapters alone (LoRA ``adapter``: the trainer's adapter
tensors; PEFT's layout, which vLLM loads, repeats the shared A of q, k, v and of gate, up). The
sync's seconds into a real engine, and PEFT's bytes, are ``bench_lora_sync.py``'s (it starts vLLM
twice per size).

Then, in the same child, the learning comparison (``learn_task``, --learn-steps; 0 skips it):
the model rebuilt from the same seed in both modes (the timing's steps moved it), the
reference as above (full: the second model loaded with the starting weights), then GRPO
steps of the trainer's math on a task a random model can make progress on: each step
--learn-prompts random prompts, --group responses each sampled from the policy itself
(plain torch, temperature 1), reward = the share of response tokens in the vocabulary's last
--target-frac, advantages ``algorithms.group_advantages`` (z-score per prompt), k3 KL at
kl_coef 0.005 against the mode's reference, ``compute_logprobs`` + ``update_policy``; full
and LoRA each at their own learning rate (--lr-full, --lr-lora). Held out before and after:
mean reward and accuracy (share of samples with reward >= --threshold) of --eval-samples
sampled responses to each of --eval-prompts prompts, the same sampling seed each time.
The defaults are those of the figures in docs/evidence/benchmarks-2026-11.md (lrs picked by a
small sweep there); the peak RSS above is taken before this part.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_memory.py --shape 100m \
        --samples 4 --prompt 32 --response 96 --repeats 2 --jobs 2   # 126M, 12 min (--learn-steps 0: 2)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_memory.py --smoke        # seconds, in-process

Not a test: numbers depend on the machine and its load. TP=1, CPU, float32.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packing import SHAPES  # noqa: E402  (the 100M shape, built in-process)

MODES = ("full", "lora")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_mode(mode: str, shape: str, rank: int, samples: int, prompt: int, response: int, repeats: int,
             learn: dict | None = None) -> dict:
    """Build ``mode``'s model, reference and optimizer; time ``repeats`` steps; return figures.
    ``learn``: then free them and run the learning comparison (``learn_task``) with these
    keyword arguments; its figures go under ``"learn"``."""
    import torch

    from grpo_mega import lora as L
    from grpo_mega.config import AlgorithmConfig, LoraConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    ps = init_parallel(1, 1, seed=0)
    cfg = ModelConfig(**SHAPES[shape], make_vocab_size_divisible_by=128)
    torch.manual_seed(0)
    model = build_model(cfg, ps)
    if mode == "lora":
        L.attach_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank), ps, seed=0)
        ref = L.ReferenceView(model)
    else:
        ref = build_model(cfg, ps, frozen=True)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-5), ps)
    algo = AlgorithmConfig(kl_coef=0.005, kl_kind="k3")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(prompt)] for _ in range(samples)]
    responses = [[rng.randrange(3, cfg.vocab_size) for _ in range(response)] for _ in range(samples)]
    adv = [rng.gauss(0, 1) for _ in range(samples)]
    kw = dict(vocab_size=cfg.vocab_size, temperature=1.0)
    steps = []
    for _ in range(repeats + 1):
        b = TrainingBatch.pack(prompts, responses, [[-1.0] * response] * samples, adv, pad_id=0,
                               device=ps.device, packing=True)
        b, sizes, _ = plan_micro_batches(b, len(b), samples, max_tokens=0, device=ps.device)
        b.ref_logp = b.empty_logp()
        micro = cut(b, sizes)[0]
        c0 = time.process_time()
        compute_logprobs(ref, micro, ps, key="ref_logp", **kw)
        c1 = time.process_time()
        update_policy(model, opt, micro, ps, algo, max_len=response, reuse_current_as_old=True, **kw)
        steps.append((c1 - c0, time.process_time() - c1))
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    ref_params = [] if mode == "lora" else list(ref.parameters())
    adapter_bytes = _bytes(trainable) if mode == "lora" else 0
    out = {"mode": mode, "params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in trainable),
            "weights_bytes": _bytes(params), "reference_bytes": _bytes(ref_params),
            # fp32 grads of the trainable parameters, held from the backward to the step
            # (ParallelAdamW frees them after it)
            "grad_bytes": sum(p.numel() * 4 for p in trainable), "optimizer_bytes": opt.state_bytes(),
            "ref_s": statistics.median(s[0] for s in steps[1:]), "update_s": statistics.median(s[1] for s in steps[1:]),
            "sync_bytes": _bytes(p for n, p in model.named_parameters() if not L.is_lora_name(n)),
            "adapter_sync_bytes": adapter_bytes,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if learn:
        # The timing's model (moved by its steps) is dropped: the learning starts from the
        # seed's weights in both modes. Its smaller batches do not raise the peak above.
        del model, ref, opt, params, trainable, ref_params, micro, b
        gc.collect()
        out["learn"] = learn_task(mode, cfg, ps, rank, **learn)
    return out


def _sample(model, prompts, new: int, vocab: int, gen):
    """``prompts: [n, p]`` long -> (``[n, new]`` tokens sampled at temperature 1 from ``model``'s
    own logits, their log-probs ``[n, new]`` float32). No KV cache: each new token reruns the
    whole sequence (at most a few dozen positions here). The output layer runs at the last
    position only (``models.head``; its mask needs one position more: a pad the causal mask
    hides from the last one)."""
    import torch

    from grpo_mega.models.gpt import forward_logits
    from grpo_mega.models.head import trainable_logits

    toks, logps = prompts, []
    with torch.no_grad():
        for _ in range(new):
            last = torch.zeros(toks.shape, dtype=torch.bool, device=toks.device)
            last[:, -1] = True
            with trainable_logits(model, last):
                logits = forward_logits(model, torch.nn.functional.pad(toks, (0, 1)))[0, :, :vocab]
            logp = torch.log_softmax(logits.float(), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            logps.append(logp.gather(1, nxt))
            toks = torch.cat([toks, nxt], dim=1)
    return toks[:, prompts.shape[1]:], torch.cat(logps, dim=1)


def _target_block(out_weight, frac: float):
    """The last ``frac`` of the vocabulary's ids: ``[V]`` bool (``out_weight: [V, h]`` gives V)."""
    import torch

    v = out_weight.shape[0]
    return torch.arange(v, device=out_weight.device) >= v - int(v * frac)


def _target_direction(out_weight, frac: float):
    """``[V]`` bool: the ``frac`` of the tokens whose output-layer row ``out_weight: [V, h]``
    (the starting model's) projects most onto one fixed random direction: a class of tokens
    that shares a direction of the hidden state, as a word class does in a trained model. A
    random model's contiguous block of ids shares none, so GRPO on it moves the sampled
    tokens' rows one by one and, in a few steps, the block's share by no more than noise."""
    import torch

    u = torch.randn(out_weight.shape[1], generator=torch.Generator().manual_seed(7)).to(out_weight)
    proj = out_weight.detach().float() @ u.float()
    return proj >= proj.quantile(1.0 - frac)


TARGETS = {"direction": _target_direction, "block": _target_block}


def target_share(responses, target):
    """The task's reward: ``responses: [n, r]`` token ids -> ``[n]`` float32, the share of each
    response's tokens in ``target: [V]`` bool (``TARGETS``, --target, --target-frac)."""
    return target[responses].float().mean(dim=1)


def _evaluate(model, prompts, samples: int, response: int, vocab: int, target,
              threshold: float, device) -> tuple[float, float]:
    """(mean reward, accuracy: share of samples with reward >= ``threshold``) of ``samples``
    sampled responses per held-out prompt, from the same generator seed at every call."""
    import torch

    gen = torch.Generator(device=device).manual_seed(12345)
    resp, _ = _sample(model, prompts.repeat_interleave(samples, dim=0), response, vocab, gen)
    r = target_share(resp, target)
    return r.mean().item(), (r >= threshold).float().mean().item()


def learn_task(mode: str, cfg, ps, rank: int, *, steps: int, lr: float, prompts: int, group: int,
               prompt_len: int, response_len: int, eval_prompts: int, eval_samples: int,
               threshold: float, target: str, target_frac: float) -> dict:
    """GRPO on a task a randomly initialised model can learn in a few steps, with the
    trainer's passes: each step samples ``group`` responses of ``response_len`` tokens to
    each of ``prompts`` random prompts from the policy itself (``_sample``), rewards each
    with ``target_share``, takes ``algorithms.group_advantages`` (z-score per prompt), fills
    the reference's log-probs (``compute_logprobs``) and runs ``update_policy`` (k3 KL,
    kl_coef 0.005, as the timed step). The same seed, prompts and sampling seeds in both modes;
    the model starts from the same weights (``torch.manual_seed(0)``, megatron's seed 0).
    Returns the held-out reward and accuracy before and after, and per-step figures."""
    import torch
    from megatron.core import tensor_parallel

    from grpo_mega import algorithms as A
    from grpo_mega import lora as L
    from grpo_mega.config import AlgorithmConfig, LoraConfig, OptimizerConfig
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_model(cfg, ps)
    vocab, dev = cfg.vocab_size, ps.device
    base_sum = sum(p.double().sum().item() for p in model.parameters())  # same start in both modes
    # The rewarded tokens, from the starting weights (the same in both modes); TP 1: the whole vocabulary.
    rewarded = TARGETS[target](model.shared_embedding_or_output_weight()[:vocab], target_frac)
    if mode == "lora":
        L.attach_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank), ps, seed=0)
        ref = L.ReferenceView(model)
    else:
        ref = build_model(cfg, ps, frozen=True)
        ref.load_state_dict(model.state_dict())
    opt = ParallelAdamW(model, OptimizerConfig(lr=lr), ps)
    algo = AlgorithmConfig(kl_coef=0.005, kl_kind="k3")
    rng = torch.Generator().manual_seed(1)
    held_out = torch.randint(3, vocab, (eval_prompts, prompt_len), generator=rng).to(dev)
    ev = dict(samples=eval_samples, response=response_len, vocab=vocab, target=rewarded,
              threshold=threshold, device=dev)
    before = _evaluate(model, held_out, **ev)
    kw = dict(vocab_size=vocab, temperature=1.0)
    curve, sample_s, train_s = [], [], []
    for step in range(steps):
        rows = torch.randint(3, vocab, (prompts, prompt_len), generator=rng).repeat_interleave(group, dim=0).to(dev)
        c0 = time.process_time()
        resp, logp = _sample(model, rows, response_len, vocab, torch.Generator(device=dev).manual_seed(1000 + step))
        reward = target_share(resp, rewarded)
        c1 = time.process_time()
        adv = A.group_advantages(reward, group)
        b = TrainingBatch.pack(rows.tolist(), resp.tolist(), logp.tolist(), adv.cpu(), pad_id=0,
                               device=dev, packing=True)
        b, sizes, _ = plan_micro_batches(b, len(b), len(b), max_tokens=0, device=dev)
        b.ref_logp = b.empty_logp()
        micro = cut(b, sizes)[0]
        compute_logprobs(ref, micro, ps, key="ref_logp", **kw)
        m = update_policy(model, opt, micro, ps, algo, max_len=response_len, reuse_current_as_old=True, **kw)
        train_s.append(time.process_time() - c1)
        sample_s.append(c1 - c0)
        curve.append({"reward": reward.mean().item(), "kl": float(m.get("kl", float("nan"))),
                      "grad_norm": float(m["grad_norm"])})
        print(f"[{mode}] step {step + 1}/{steps} reward {curve[-1]['reward']:.3f} kl {curve[-1]['kl']:.2e}",
              file=sys.stderr, flush=True)
    after = _evaluate(model, held_out, **ev)
    med = (lambda xs: statistics.median(xs) if xs else float("nan"))
    return {"lr": lr, "steps": steps, "base_sum": base_sum, "target": target,
            "target_frac": rewarded.float().mean().item(),
            "reward_before": before[0], "accuracy_before": before[1],
            "reward_after": after[0], "accuracy_after": after[1], "curve": curve,
            "sample_s": med(sample_s), "train_s": med(train_s)}


def _report(rows: dict, args, load: float) -> None:
    mib = 2 ** 20
    print(f"model {args.shape}, {rows['full']['params'] / 1e6:.1f}M params, float32, TP 1, CPU; "
          f"LoRA rank {args.rank} on qkv/proj/fc1/fc2 ({rows['lora']['trainable'] / 1e6:.2f}M trainable); "
          f"batch {args.samples} rows x ({args.prompt} + {args.response}) tokens, one micro-batch, packed; "
          f"median of {args.repeats} steps after a warm-up (CPU s, one thread); load average {load:.1f}")
    print(f"{'mode':<6}{'trainable M':>12}{'weights MiB':>12}{'ref MiB':>9}{'grads MiB':>10}{'optim MiB':>10}"
          f"{'state MiB':>10}{'peak RSS MiB':>13}{'ref s':>8}{'update s':>9}{'sync MB':>9}")
    for m in MODES:
        r = rows[m]
        r["state_bytes"] = r["weights_bytes"] + r["reference_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        sync = r["adapter_sync_bytes"] or r["sync_bytes"]
        print(f"{m:<6}{r['trainable'] / 1e6:>12.2f}{r['weights_bytes'] / mib:>12.1f}{r['reference_bytes'] / mib:>9.1f}"
              f"{r['grad_bytes'] / mib:>10.1f}{r['optimizer_bytes'] / mib:>10.1f}{r['state_bytes'] / mib:>10.1f}"
              f"{r['peak_rss_mib']:>13.0f}{r['ref_s']:>8.3f}{r['update_s']:>9.3f}{sync / 1e6:>9.2f}")
    f, lo = rows["full"], rows["lora"]
    print(f"lora / full: state {lo['state_bytes'] / f['state_bytes']:.3f}x, peak RSS "
          f"{lo['peak_rss_mib'] / f['peak_rss_mib']:.3f}x, update {lo['update_s'] / f['update_s']:.2f}x, "
          f"reference pass {lo['ref_s'] / f['ref_s']:.2f}x; sync: full {f['sync_bytes'] / 1e6:.2f} MB, "
          f"merged {lo['sync_bytes'] / 1e6:.2f} MB, adapter {lo['adapter_sync_bytes'] / 1e6:.2f} MB")
    if "learn" in f:
        _report_learning(rows, args)


def _report_learning(rows: dict, args) -> None:
    f = rows["full"]["learn"]
    print(f"learning: GRPO, {f['steps']} steps of {args.learn_prompts} random prompts x {args.group} samples, "
          f"{args.learn_prompt} prompt + {args.learn_response} response tokens sampled from the policy at T=1; "
          f"reward = share of response tokens in the rewarded {f['target_frac']:.3f} of the vocabulary "
          f"(--target {f['target']}); "
          f"held out: {args.eval_prompts} prompts x {args.eval_samples} samples at T=1, "
          f"accuracy = share of samples with reward >= {args.threshold}")
    print(f"{'mode':<6}{'lr':>9}{'reward 0':>10}{'acc 0':>8}{'reward N':>10}{'acc N':>8}"
          f"{'train reward first 3 / last 3':>31}{'sample s':>10}{'train s':>9}")
    for m in MODES:
        r = rows[m]["learn"]
        c = [x["reward"] for x in r["curve"]]
        first, last = statistics.mean(c[:3]) if c else float("nan"), statistics.mean(c[-3:]) if c else float("nan")
        print(f"{m:<6}{r['lr']:>9.0e}{r['reward_before']:>10.3f}{r['accuracy_before']:>8.3f}"
              f"{r['reward_after']:>10.3f}{r['accuracy_after']:>8.3f}{first:>20.3f} / {last:.3f}"
              f"{r['sample_s']:>10.2f}{r['train_s']:>9.2f}")
    same = rows["lora"]["learn"]["base_sum"] == f["base_sum"]
    print(f"same initial weights in both modes: {same}; train reward per step: "
          + "; ".join(f"{m} " + " ".join(f"{x['reward']:.2f}" for x in rows[m]["learn"]["curve"]) for m in MODES))


def _children(argv: list[str], jobs: int) -> dict:
    """Each mode's figures from its own child process, ``jobs`` at a time (its peak RSS
    and CPU seconds are its own either way; 2 halves the wall time on a loaded machine)."""
    rows, pending = {}, list(MODES)
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        procs = {m: subprocess.Popen([sys.executable, __file__, "--child", m] + argv,
                                     stdout=subprocess.PIPE, text=True) for m in batch}
        for m, proc in procs.items():
            out = proc.communicate()[0]
            if proc.returncode:
                raise RuntimeError(f"the {m} child exited with {proc.returncode}")
            rows[m] = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    return rows


def _learn_kw(args, mode: str) -> dict | None:
    if args.learn_steps <= 0:
        return None
    return dict(steps=args.learn_steps, lr=args.lr_lora if mode == "lora" else args.lr_full,
                prompts=args.learn_prompts, group=args.group, prompt_len=args.learn_prompt,
                response_len=args.learn_response, eval_prompts=args.eval_prompts,
                eval_samples=args.eval_samples, threshold=args.threshold, target=args.target,
                target_frac=args.target_frac)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--learn-steps", type=int, default=12, help="GRPO steps of the learning comparison (0: none)")
    ap.add_argument("--learn-prompts", type=int, default=8, help="prompts per learning step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--learn-prompt", type=int, default=8, help="prompt tokens in the learning task")
    ap.add_argument("--learn-response", type=int, default=4, help="response tokens in the learning task")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts")
    ap.add_argument("--eval-samples", type=int, default=4, help="sampled responses per held-out prompt")
    ap.add_argument("--target", choices=sorted(TARGETS), default="direction",
                    help="the rewarded tokens: those whose output row projects most on a fixed "
                         "direction, or the last ids (a block)")
    ap.add_argument("--target-frac", type=float, default=0.5, help="the rewarded share of the vocabulary")
    ap.add_argument("--threshold", type=float, default=0.75, help="accuracy: share of samples with reward >= this")
    ap.add_argument("--lr-full", type=float, default=3e-3, help="learning rate of full fine-tuning")
    ap.add_argument("--lr-lora", type=float, default=3e-2, help="learning rate of LoRA")
    ap.add_argument("--jobs", type=int, default=1, choices=(1, 2), help="mode children run at once")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one repeat, both modes in this process")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.rank, args.samples, args.prompt, args.response, args.repeats = "smoke", 4, 2, 8, 8, 1
        args.learn_steps, args.learn_prompts, args.group, args.learn_prompt = min(args.learn_steps, 1), 2, 4, 4
        args.learn_response, args.eval_prompts, args.eval_samples = 4, 2, 2
    run = dict(shape=args.shape, rank=args.rank, samples=args.samples, prompt=args.prompt,
               response=args.response, repeats=args.repeats)
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, **run, learn=_learn_kw(args, args.child))), flush=True)
        return {}
    rows = {}
    if args.smoke:  # in-process: the RSS column is then the process's, not the mode's
        from grpo_mega.distributed.state import destroy_parallel
        for m in MODES:
            try:
                rows[m] = run_mode(m, **run, learn=_learn_kw(args, m))
            finally:
                destroy_parallel()
    else:
        rows = _children(list(argv if argv is not None else sys.argv[1:]), args.jobs)
    _report(rows, args, os.getloadavg()[0])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
