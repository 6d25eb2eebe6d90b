"""The learning half of ``bench_lora_memory.py``: does LoRA learn what full fine-tuning learns?

Users fine-tune trained models, and a random model is a poor stand-in: its output rows are
noise, and LoRA (which leaves the output layer and the final norm as they are) can then move
the logits very little. No pretrained model can be downloaded here, so the benchmark trains
a small base itself (``warm_start``, --warm-steps; 0: the random model, kept for comparison):
full-parameter next-token training (cross-entropy, AdamW, fixed seed) on a synthetic
language with a latent class (``Language``): 64 token ids S in two classes A and B of 32;
each sequence draws its class, then every token from that class (from the other one with
probability --warm-noise). The trained base emits tokens of S and continues the class of
its prompt, its output rows for A and B apart along a learned hidden direction, as word
classes are in a pretrained model. The base is trained once, in a process of its own, and
saved; both modes load the same file.

The RL task (``--target class``): prompts of the language, half of class A and half of B;
reward = the share of response tokens in A. The base scores about 0.5 (it answers B prompts
in B), and both modes must learn to answer in A whatever the prompt: a shift of the hidden
state along the class direction, which adapters on qkv, proj, fc1 and fc2 can make. The
random-start task of the first figures (``--target direction``, with --warm-steps 0) is kept.

``learn_task`` runs GRPO with the trainer's passes: ``compute_logprobs`` for the reference,
``update_policy``, ``algorithms.group_advantages``, k3 KL against the mode's reference.
Run through ``bench_lora_memory.py`` (its docstring has the commands).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Language:
    """The warm start's synthetic language. ``a``, ``b``: ``[k]`` token ids of the two
    classes (S = both, drawn from the vocabulary by a fixed seed, ids 0-2 left out as
    specials); ``noise``: the chance that a token comes from the other class."""
    a: torch.Tensor
    b: torch.Tensor
    noise: float

    @staticmethod
    def make(vocab: int, size: int = 64, noise: float = 0.1, seed: int = 7) -> "Language":
        ids = 3 + torch.randperm(vocab - 3, generator=torch.Generator().manual_seed(seed))[:size]
        return Language(ids[: size // 2], ids[size // 2:], noise)

    def sample(self, classes: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
        """``classes: [n]`` long (0: A, 1: B) -> ``[n, length]`` token ids of sequences of those classes."""
        own = torch.stack([self.a, self.b])  # [2, k]
        flip = (torch.rand(len(classes), length, generator=gen) < self.noise).long()
        pick = torch.randint(0, own.shape[1], (len(classes), length), generator=gen)
        return own[(classes[:, None] + flip) % 2, pick]

    def members(self, vocab: int, which: torch.Tensor) -> torch.Tensor:
        """``[V]`` bool: the ids of ``which`` (``self.a``, ``self.b`` or both)."""
        out = torch.zeros(vocab, dtype=torch.bool)
        out[which] = True
        return out


def _alternating(n: int) -> torch.Tensor:
    """``[n]`` classes A, B, A, B...: half the prompts of each class."""
    return torch.arange(n) % 2


def _next_token_logits(model, toks: torch.Tensor, vocab: int) -> torch.Tensor:
    """``toks: [n, s]`` -> float32 logits ``[n, s-1, V]`` of tokens 1..s-1 (TP 1: the whole vocabulary)."""
    from grpo_mega.models.gpt import forward_logits

    return forward_logits(model, toks)[:, :-1, :vocab].float()


def warm_start(cfg, ps, *, steps: int, lr: float, batch: int, length: int, noise: float, seed: int = 0):
    """Build the base (``torch.manual_seed(seed)``, megatron's seed too) and train it for
    ``steps`` steps of next-token cross-entropy on ``batch`` sequences of ``length`` tokens of
    ``Language.make(vocab, noise=noise)``, every parameter, ``torch.optim.AdamW(lr)``, no
    weight decay. Returns (its state dict, figures: the held-out cross-entropy, and the mean
    probability the base puts on S and on the sequence's own class at the last position of
    64 held-out sequences, before and after, and the CPU seconds)."""
    from megatron.core import tensor_parallel

    from grpo_mega.models import build_model

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = build_model(cfg, ps)
    vocab, dev = cfg.vocab_size, ps.device
    lang = Language.make(vocab, noise=noise)
    gen = torch.Generator().manual_seed(seed + 2)
    held = _alternating(64)
    held_toks = lang.sample(held, length, torch.Generator().manual_seed(seed + 3)).to(dev)
    fig = {"steps": steps, "lr": lr, "batch": batch, "length": length, "noise": noise,
           "tokens": len(lang.a) + len(lang.b), "before": _base_figures(model, lang, held, held_toks, vocab)}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0) if steps else None
    c0 = time.process_time()
    for step in range(steps):
        toks = lang.sample(torch.randint(0, 2, (batch,), generator=gen), length, gen).to(dev)
        logits = _next_token_logits(model, toks, vocab)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), toks[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 9 and step < steps - 1:  # how many steps the base needs, in the log
            f = _base_figures(model, lang, held, held_toks, vocab)
            print(f"[base] step {step + 1}/{steps} loss {loss.item():.3f} held out: on S {f['on_s']:.3f}, "
                  f"on the class {f['on_class']:.3f}", file=sys.stderr, flush=True)
    fig["cpu_s"] = time.process_time() - c0  # the held-out passes of the log included
    fig["after"] = _base_figures(model, lang, held, held_toks, vocab)
    fig["base_sum"] = sum(p.double().sum().item() for p in model.parameters())
    return model.state_dict(), fig


def _base_figures(model, lang: Language, classes, toks, vocab: int) -> dict:
    """``toks: [n, s]`` held-out sequences of ``classes: [n]`` -> the mean next-token
    cross-entropy, and the mean probability on S and on each sequence's class at its last
    position (the prediction after s-1 tokens, as at the end of an RL prompt)."""
    with torch.no_grad():
        logits = _next_token_logits(model, toks, vocab)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), toks[:, 1:].reshape(-1)).item()
        p = torch.softmax(logits[:, -1], dim=-1).cpu()  # [n, V]
    in_a, in_b = lang.members(vocab, lang.a), lang.members(vocab, lang.b)
    on_a, on_b = p[:, in_a].sum(1), p[:, in_b].sum(1)
    own = torch.where(classes == 0, on_a, on_b)
    return {"ce": ce, "on_s": (on_a + on_b).mean().item(), "on_class": own.mean().item()}


def _sample(model, prompts, new: int, vocab: int, gen):
    """``prompts: [n, p]`` long -> (``[n, new]`` tokens sampled at temperature 1 from ``model``'s
    own logits, their log-probs ``[n, new]`` float32). No KV cache: each new token reruns the
    whole sequence (at most a few dozen positions here). The output layer runs at the last
    position only (``models.head``; its mask needs one position more: a pad the causal mask
    hides from the last one)."""
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
    v = out_weight.shape[0]
    return torch.arange(v, device=out_weight.device) >= v - int(v * frac)


def _target_direction(out_weight, frac: float):
    """``[V]`` bool: the ``frac`` of the tokens whose output-layer row ``out_weight: [V, h]``
    (the starting model's) projects most onto one fixed random direction. A random model's
    contiguous block of ids shares no direction, so GRPO on it moves the sampled tokens' rows
    one by one and, in a few steps, the block's share by no more than noise; this class at
    least shares one, though at a random start only full fine-tuning, which moves the output
    rows themselves, learns it (docs/evidence/benchmarks-2026-11.md)."""
    u = torch.randn(out_weight.shape[1], generator=torch.Generator().manual_seed(7)).to(out_weight)
    proj = out_weight.detach().float() @ u.float()
    return proj >= proj.quantile(1.0 - frac)


TARGETS = {"direction": _target_direction, "block": _target_block}


def target_share(responses, target):
    """The task's reward: ``responses: [n, r]`` token ids -> ``[n]`` float32, the share of each
    response's tokens in ``target: [V]`` bool (class A of ``Language``, or ``TARGETS``)."""
    return target[responses].float().mean(dim=1)


def _evaluate(model, prompts, samples: int, response: int, vocab: int, target, device):
    """``[n * samples]`` rewards of ``samples`` sampled responses per held-out prompt
    (``prompts: [n, p]``), from the same generator seed at every call."""
    gen = torch.Generator(device=device).manual_seed(12345)
    resp, _ = _sample(model, prompts.repeat_interleave(samples, dim=0), response, vocab, gen)
    return target_share(resp, target).cpu()


def _task(target: str, out_weight, vocab: int, target_frac: float, noise: float):
    """(the rewarded ids ``[V]`` bool, ``prompts(n, length, gen) -> ([n, length] ids, [n] class)``)."""
    if target == "class":
        lang = Language.make(vocab, noise=noise)
        return lang.members(vocab, lang.a), lambda n, length, gen: (
            lang.sample(_alternating(n), length, gen), _alternating(n))
    # TP 1: the output layer holds the whole vocabulary.
    return TARGETS[target](out_weight[:vocab], target_frac).cpu(), lambda n, length, gen: (
        torch.randint(3, vocab, (n, length), generator=gen), torch.zeros(n, dtype=torch.long))


def learn_task(mode: str, cfg, ps, rank: int, *, base: str, steps: int, lr: float, prompts: int, group: int,
               prompt_len: int, response_len: int, eval_prompts: int, eval_samples: int,
               threshold: float, target: str, target_frac: float, noise: float) -> dict:
    """GRPO from the base saved at ``base`` (``warm_start``'s state dict), with the trainer's
    passes: each step samples ``group`` responses of ``response_len`` tokens to each of
    ``prompts`` prompts (``_task``) from the policy itself (``_sample``), rewards each with
    ``target_share``, takes ``algorithms.group_advantages`` (z-score per prompt), fills the
    reference's log-probs (``compute_logprobs``: full, a frozen copy of the base; LoRA, the
    actor with adapters off) and runs ``update_policy`` (k3 KL, kl_coef 0.005). The same
    prompts and sampling seeds in both modes. Returns the held-out reward and accuracy
    (share of samples with reward >= ``threshold``) before and after, and per-step figures."""
    from grpo_mega import algorithms as A
    from grpo_mega import lora as L
    from grpo_mega.config import AlgorithmConfig, LoraConfig, OptimizerConfig
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    start = torch.load(base, weights_only=True)
    model = build_model(cfg, ps)
    model.load_state_dict(start)
    vocab, dev = cfg.vocab_size, ps.device
    base_sum = sum(p.double().sum().item() for p in model.parameters())  # the same start in both modes
    rewarded, make_prompts = _task(target, model.shared_embedding_or_output_weight(), vocab, target_frac, noise)
    if mode == "lora":
        L.attach_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank), ps, seed=0)
        ref = L.ReferenceView(model)
    else:
        ref = build_model(cfg, ps, frozen=True)
        ref.load_state_dict(start)
    del start
    opt = ParallelAdamW(model, OptimizerConfig(lr=lr), ps)
    algo = AlgorithmConfig(kl_coef=0.005, kl_kind="k3")
    rng = torch.Generator().manual_seed(1)
    held_out, held_class = make_prompts(eval_prompts, prompt_len, rng)
    held_b = held_class.repeat_interleave(eval_samples) == 1
    ev = dict(samples=eval_samples, response=response_len, vocab=vocab, target=rewarded, device=dev)
    before = _evaluate(model, held_out.to(dev), **ev)
    kw = dict(vocab_size=vocab, temperature=1.0)
    curve, sample_s, train_s = [], [], []
    for step in range(steps):
        rows = make_prompts(prompts, prompt_len, rng)[0].repeat_interleave(group, dim=0).to(dev)
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
    after = _evaluate(model, held_out.to(dev), **ev)
    med = (lambda xs: statistics.median(xs) if xs else float("nan"))
    out = {"lr": lr, "steps": steps, "base_sum": base_sum, "target": target,
           "target_frac": rewarded.float().mean().item(), "curve": curve,
           "sample_s": med(sample_s), "train_s": med(train_s)}
    for when, r in (("before", before), ("after", after)):
        out[f"reward_{when}"], out[f"accuracy_{when}"] = r.mean().item(), (r >= threshold).float().mean().item()
        if held_b.any():  # where the base answers against the reward (class task: B prompts)
            out[f"reward_b_{when}"] = r[held_b].mean().item()
    return out


def report_base(base: dict) -> None:
    b, a = base["before"], base["after"]
    print(f"base: {base['steps']} steps of next-token training (AdamW lr {base['lr']:.0e}, {base['batch']} "
          f"sequences x {base['length']} tokens of the class language: {base['tokens']} ids, 2 classes, "
          f"noise {base['noise']}), {base['cpu_s']:.0f} CPU s; held out, last position: cross-entropy "
          f"{b['ce']:.2f} -> {a['ce']:.2f}, mass on S {b['on_s']:.3f} -> {a['on_s']:.3f}, on the "
          f"sequence's class {b['on_class']:.3f} -> {a['on_class']:.3f}")


def report_learning(rows: dict, args, modes) -> None:
    f = rows["full"]["learn"]
    what = ("the class language's prompts (half A, half B); reward = share of response tokens in class A"
            if f["target"] == "class" else
            f"random prompts; reward = share of response tokens in the rewarded {f['target_frac']:.3f} "
            f"of the vocabulary (--target {f['target']})")
    print(f"learning: GRPO, {f['steps']} steps of {args.learn_prompts} prompts x {args.group} samples, "
          f"{args.learn_prompt} prompt + {args.learn_response} response tokens sampled from the policy at T=1; "
          f"{what}; held out: {args.eval_prompts} prompts x {args.eval_samples} samples at T=1, "
          f"accuracy = share of samples with reward >= {args.threshold}")
    print(f"{'mode':<6}{'lr':>9}{'reward 0':>10}{'acc 0':>8}{'B 0':>7}{'reward N':>10}{'acc N':>8}{'B N':>7}"
          f"{'train reward first 3 / last 3':>31}{'sample s':>10}{'train s':>9}")
    nan = float("nan")
    for m in modes:
        r = rows[m]["learn"]
        c = [x["reward"] for x in r["curve"]]
        first, last = statistics.mean(c[:3]) if c else nan, statistics.mean(c[-3:]) if c else nan
        print(f"{m:<6}{r['lr']:>9.0e}{r['reward_before']:>10.3f}{r['accuracy_before']:>8.3f}"
              f"{r.get('reward_b_before', nan):>7.3f}{r['reward_after']:>10.3f}{r['accuracy_after']:>8.3f}"
              f"{r.get('reward_b_after', nan):>7.3f}{first:>20.3f} / {last:.3f}"
              f"{r['sample_s']:>10.2f}{r['train_s']:>9.2f}")
    same = rows["lora"]["learn"]["base_sum"] == f["base_sum"]
    print(f"same initial weights in both modes: {same}; train reward per step: "
          + "; ".join(f"{m} " + " ".join(f"{x['reward']:.2f}" for x in rows[m]["learn"]["curve"]) for m in modes))
