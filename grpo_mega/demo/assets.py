"""The embedded demo's task and starting checkpoint, built locally and cached.

Task: two-digit addition, ``"37+45="`` -> ``"82"`` then end-of-sequence, exact
match. 200 problems are held out for evaluation, the rest feed GRPO.

Starting point: a tiny Qwen2 (hidden 128, 4 heads of 32, 2 layers, tied
embeddings, QKV bias) with a character-level sentencepiece tokenizer, given a
short supervised warm start so the policy starts weak but not hopeless
(about 30-45% held-out greedy accuracy): GRPO needs some correct samples in a
group to have any signal at all.

The mixture-of-experts variant (``variant="moe"``, ``make demo ARGS=--moe``) is the same
task and tokenizer on a tiny Qwen3-MoE (hidden 128, 4 heads of 32, 2 layers, every layer
4 experts of width 128 with top-2 renormalised routing, QK-norm, untied head), warm
started the same way.

Copies built by this module ship in ``grpo_mega/assets/demo_v1`` (1.6 MB) and
``grpo_mega/assets/demo_moe_v1``, so ``make demo`` starts at once; ``rebuild=True``
(``tools/make_demo_model.py --rebuild [--moe]``) makes a fresh one (about 3-6 minutes
on 2 busy cores). A rebuild lands in ``.cache/demo/<version>/`` and is reused:
``tokenizer/`` (HF dir), ``hf/`` (the warm-started HF checkpoint),
``train.jsonl``, ``eval.jsonl``.

    python tools/make_demo_model.py            # or: python -m grpo_mega.demo.assets
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

# No module-level torch: the reward workers import this module for exact_match_reward, and
# torch would be ~1.5 CPU-s of each worker's start (the functions that need it import it).

VERSION = "v1"
VARIANTS = {
    # variant: (asset version, HF family, build_tiny_hf_checkpoint keywords, warm-start
    # steps between accuracy checks: the MoE model's accuracy jumps 27% -> 52% in 50 steps)
    "dense": (VERSION, "qwen2", dict(intermediate_size=256), 50),
    # near-uniform routing at the start (router std 0.02): with std 1 the warm-started
    # model's routing was peaky and GRPO gained 16 points in 400 steps instead of 31
    "moe": ("moe_v1", "qwen3_moe", dict(tie_word_embeddings=False, router_init_std=0.02,
                                         moe=dict(num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=128)), 10),
}
"""The demo's models: the same task, tokenizer and warm start, dense or mixture-of-experts."""
EVAL_SIZE = 200
TARGET_ACC = (0.30, 0.50)  # warm start stops once held-out accuracy enters this window


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(rows)
    return rows[EVAL_SIZE:], rows[:EVAL_SIZE]


def exact_match_reward(prompt, completion, reference, metadata=None, **_) -> float:
    """1.0 when the completion is exactly the answer (whitespace-trimmed), else 0."""
    return 1.0 if completion.strip() == str(reference).strip() else 0.0


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _build_tokenizer(out: Path) -> Path:
    from grpo_mega.data.tokenizer import train_sentencepiece, write_hf_tokenizer_dir

    texts = [f"{a}+{b}={a + b}" for a in range(100) for b in range(100)]
    model = train_sentencepiece(texts, out / "spm" / "arith", vocab_size=20, model_type="char",
                                byte_fallback=False)
    return write_hf_tokenizer_dir(model, out / "tokenizer")


def greedy_accuracy(model, tok, rows: list[dict], max_new: int = 5) -> float:
    """Batched greedy decoding with the HF model (prompts right-aligned by length buckets)."""
    import torch

    with torch.no_grad():
        return _greedy_accuracy(torch, model, tok, rows, max_new)


def _greedy_accuracy(torch, model, tok, rows: list[dict], max_new: int) -> float:
    correct = 0
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(len(tok.encode(r["prompt"])), []).append(r)
    for _, group in by_len.items():
        ids = torch.tensor([tok.encode(r["prompt"]) for r in group])
        done = torch.zeros(len(group), dtype=torch.bool)
        outs = [[] for _ in group]
        for _ in range(max_new):
            nxt = model(ids).logits[:, -1].argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    if t == tok.eos_id:
                        done[i] = True
                    else:
                        outs[i].append(t)
            ids = torch.cat([ids, nxt[:, None]], 1)
        for r, o, d in zip(group, outs, done.tolist()):
            correct += int(d and tok.decode(o).strip() == r["answer"])
    return correct / max(len(rows), 1)


def answer_tokens(tok, row: dict) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of one addition problem: the prompt, then the answer and eos,
    which alone are trained on."""
    p, a = tok.encode(row["prompt"]), tok.encode(row["answer"]) + [tok.eos_id]
    return p + a, [0] * len(p) + [1] * len(a)


def supervised_warm_start(hf_dir: Path, tok, train: list[dict], evals: list[dict],
                          encode: Callable[[object, dict], tuple[list[int], list[int]]],
                          accuracy: Callable[[object, object, list[dict]], float], *,
                          lr: float, check_every: int, seed: int = 0) -> float:
    """Supervised AdamW steps on the HF checkpoint in ``hf_dir``, 64 rows of ``train`` each,
    on the tokens ``encode(tok, row) -> (ids, loss_mask)`` marks, until
    ``accuracy(model, tok, evals)`` (checked every ``check_every`` steps) enters TARGET_ACC
    or 3000 steps have run. Saves the model back into ``hf_dir``; returns that accuracy.

    Both demos (addition, and the tool-use episodes of ``demo.tools``) warm start through
    this one loop; a rebuild with the same seed repeats the packaged assets' draws."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    acc, t0, step = 0.0, time.time(), 0
    while True:
        seqs, masks = zip(*(encode(tok, r) for r in rng.sample(train, 64)))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        model.train()
        logits = model(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % check_every == 0:
            model.eval()
            acc = accuracy(model, tok, evals)
            say(f"  warm start step {step}: loss {loss.item():.3f}, held-out greedy accuracy "
                f"{acc:.1%} ({time.time() - t0:.0f}s)")
            if acc >= TARGET_ACC[0] or step >= 3000:
                break
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    return acc


ASSETS = Path(__file__).resolve().parent.parent / "assets"
PACKAGED = ASSETS / f"demo_{VERSION}"


def cached_build(version: str, cache_dir: str | os.PathLike, rebuild: bool, what: str,
                 build: Callable[[Path], float]) -> Path:
    """The packaged ``assets/demo_<version>``, else the cached ``<cache_dir>/<version>``, else
    (or with ``rebuild``) ``build(tmp_dir) -> warm-start accuracy`` into a temporary directory
    renamed into place when done, so a killed build leaves only ``.tmp``, rebuilt next time."""
    packaged = ASSETS / f"demo_{version}"
    if not rebuild and (packaged / "DONE").exists():
        say(f"using the packaged {what} ({packaged})")
        return packaged
    root = Path(cache_dir) / version
    if rebuild:
        shutil.rmtree(root, ignore_errors=True)
    if (root / "DONE").exists():
        say(f"using cached {what} in {root}")
        return root
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    acc = build(tmp)
    (tmp / "warm_start.json").write_text(json.dumps({"heldout_greedy_accuracy": acc}))
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    say(f"{what} ready in {root} (warm-start accuracy {acc:.1%})")
    return root


def ensure_demo_assets(cache_dir: str | os.PathLike = ".cache/demo", rebuild: bool = False,
                       variant: str = "dense") -> Path:
    """Reuse the packaged or cached demo tokenizer, data and warm-started checkpoint of
    ``variant`` (a key of ``VARIANTS``), or build them (``rebuild=True``, or when neither
    exists)."""
    if variant not in VARIANTS:
        raise ValueError(f"demo variant {variant!r}; choose one of {sorted(VARIANTS)}")
    version, family, shape, check_every = VARIANTS[variant]

    def build(tmp: Path) -> float:
        say("step 1/3: training a character-level sentencepiece tokenizer")
        tok_dir = _build_tokenizer(tmp)
        from grpo_mega.testing.tiny import build_tiny_hf_checkpoint
        from grpo_mega.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tok_dir)
        train, evals = problems()
        _write_jsonl(tmp / "train.jsonl", train)
        _write_jsonl(tmp / "eval.jsonl", evals)
        say(f"step 2/3: building a tiny {family} (vocab {tok.vocab_size}, hidden 128, 2 layers)")
        hf = build_tiny_hf_checkpoint(tmp / "hf", family=family, hidden_size=128, num_layers=2,
                                      num_heads=4, num_kv_heads=2, tokenizer_dir=tok_dir, seed=0,
                                      max_position_embeddings=64, **shape)
        say("step 3/3: supervised warm start (stops at 30-50% held-out accuracy, ~1 min)")
        return supervised_warm_start(hf, tok, train, evals, answer_tokens, greedy_accuracy,
                                     lr=1e-3, check_every=check_every)

    return cached_build(version, cache_dir, rebuild, "demo model and data", build)

if __name__ == "__main__":
    ensure_demo_assets(sys.argv[1] if len(sys.argv) > 1 else ".cache/demo", rebuild=True,
                       variant=sys.argv[2] if len(sys.argv) > 2 else "dense")
