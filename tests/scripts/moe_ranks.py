"""One 4-rank gloo launch for the mixture-of-experts checks (tests/unit/models/test_moe.py).

A tiny Qwen3-MoE (4 experts, top-2, 2 layers) is written by transformers; then:
  * HF -> mcore with tools' ``hf_to_mcore`` (4 ranks share the work), mcore -> HF, and the
    original HF tensors are compared bitwise;
  * per layout (tp, ep) in LAYOUTS the model is built, loaded from the mcore checkpoint,
    and one forward/backward runs on this DP rank's share of a fixed global batch; after
    the optimizer's gradient reduction (``ParallelAdamW.reduce_grads``) every rank reports
    its logits, the global loss, and its gradients under HF names (experts: only the ones it
    holds), so the test can compare EP2 with EP1 at the same TP and DP;
  * at TP1/EP1 the logits are also compared with transformers on the same batch;
  * at TP2 x EP2 and PP2 x EP2 the bridge exports the loaded model in small buckets and
    every rank reports which HF tensors differ from (or are missing against) the original.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

# (tp, ep, moe_aux_loss_coeff) at world 4, pp 1; dp = 4 / tp. The load-balancing loss is
# not additive over DP shares of a batch, so runs with it compare at equal DP only.
AUX_COEFF = 1e-2
LAYOUTS = [(1, 1, AUX_COEFF), (1, 2, AUX_COEFF), (1, 1, 0.0), (2, 1, 0.0), (2, 2, 0.0)]
GLOBAL_BATCH, SEQ = 8, 12
EXPORT_LAYOUTS = [(2, 1, 2), (1, 2, 2)]  # (tp, pp, ep)
SMALL_BUCKET = 64 * 1024


def _reinit(tp: int, ep: int, pp: int = 1):
    from megatron.core import parallel_state as mpu

    from grpo_mega.distributed.state import init_parallel
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    return init_parallel(tp, pp, ep=ep, seed=3)


def _export_diff(cfg, ckpt: Path, want: dict, tp: int, pp: int, ep: int) -> tuple[list[str], list]:
    """Names the bridge got wrong at this layout (missing, extra, duplicated or unequal),
    and the HF names of each bucket it yielded."""
    from grpo_mega.bridge.export import export_buckets
    from grpo_mega.checkpoint.convert import load_mcore_weights
    from grpo_mega.models.gpt import build_model

    ps = _reinit(tp, ep, pp)
    model = build_model(cfg, ps)
    load_mcore_weights(model, ckpt, ps, cfg)
    got, bad, buckets = {}, [], []
    for bucket in export_buckets(model, cfg, ps, bucket_bytes=SMALL_BUCKET):
        buckets.append([name for name, _ in bucket])
        for name, t in bucket:
            if name in got:
                bad.append(f"twice: {name}")
            got[name] = t.clone()
    bad += [f"missing: {n}" for n in sorted(set(want) - set(got))]
    bad += [f"extra: {n}" for n in sorted(set(got) - set(want))]
    bad += [f"differs: {n}" for n in sorted(set(want) & set(got)) if not torch.equal(want[n], got[n])]
    return bad, buckets


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(11))


def _step(cfg, ckpt: Path, tp: int, ep: int) -> dict:
    """Forward + backward on this DP rank's rows; grads reduced by the optimizer."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from grpo_mega.checkpoint.convert import load_mcore_weights
    from grpo_mega.config import OptimizerConfig
    from grpo_mega.models import hf as mapping
    from grpo_mega.models import layout
    from grpo_mega.models.gpt import build_model, forward_logits, mask_vocab_padding
    from grpo_mega.optim.adamw import ParallelAdamW, global_grad_norm

    ps = _reinit(tp, ep)
    model = build_model(cfg, ps)
    load_mcore_weights(model, ckpt, ps, cfg)
    tokens = _tokens(cfg.vocab_size)
    rows = tokens.chunk(ps.dp)[ps.dp_rank]
    logits = forward_logits(model, rows[:, :-1])
    logits = mask_vocab_padding(logits, cfg.vocab_size, ps.tp_rank)
    nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), rows[:, 1:].t().contiguous())
    loss = nll.sum() / tokens[:, 1:].numel()  # normalised by the global token count
    loss.backward()
    opt = ParallelAdamW(model, OptimizerConfig(), ps)
    opt.reduce_grads()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=ps.dp_group)
    off, grads = layout.expert_offset(model, ps), {}
    for local, p in model.named_parameters():
        name = layout.to_global_name(local, 0, cfg.num_layers, off)
        full = layout.gather(name, p.grad, ps.tp_group, ps.tp, cfg.vocab_size)
        grads.update(mapping.canonical_to_hf(name, full, cfg))
    full_logits = [torch.empty_like(logits) for _ in range(ps.tp)]
    torch.distributed.all_gather(full_logits, logits.contiguous(), group=ps.tp_group)
    return {"logits": torch.cat(full_logits, -1)[..., :cfg.vocab_size].detach(), "dp_rank": ps.dp_rank,
            "loss": float(total), "grads": grads, "grad_norm": global_grad_norm(opt.main, ps),
            "model": model, "ps": ps}


def _rank_main(rank: int, world: int, root: str) -> dict:
    import dataclasses

    from grpo_mega.checkpoint import convert
    from grpo_mega.checkpoint.convert import load_hf_weights
    from grpo_mega.models import layout
    from grpo_mega.models.gpt import build_model
    from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint

    root = Path(root)
    hf_dir = root / "hf"
    if rank == 0:
        write_hf_checkpoint(hf_dir, "qwen3_moe", tie=False, seed=5)
    torch.distributed.barrier()
    report: dict = {}
    convert.hf_to_mcore(hf_dir, root / "mcore", progress=None)
    convert.mcore_to_hf(root / "mcore", root / "back", progress=None)
    if rank == 0:
        a, b = read_hf_tensors(hf_dir), read_hf_tensors(root / "back")
        report["roundtrip"] = sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]
        report["num_hf_tensors"] = len(a)
    for tp, ep, aux in LAYOUTS:
        cfg = dataclasses.replace(convert.read_model_config(root / "mcore"), moe_aux_loss_coeff=aux)
        out = _step(cfg, root / "mcore", tp, ep)
        model, ps = out.pop("model"), out.pop("ps")
        if (tp, ep) == (2, 2):
            # the direct HF load (the trainer's other start path) gives the same shards
            other = build_model(cfg, ps)
            load_hf_weights(other, hf_dir, ps, cfg)
            theirs = dict(other.named_parameters())
            report["hf_load_equals_mcore_load"] = all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
            report["local_experts"] = list(ps.local_experts(cfg.num_experts))
            report["expert_offset"] = layout.expert_offset(model, ps)
        report[f"tp{tp} ep{ep} aux{aux}"] = out
    original = read_hf_tensors(hf_dir)
    for tp, pp, ep in EXPORT_LAYOUTS:
        report[f"export tp{tp} pp{pp} ep{ep}"], report[f"buckets tp{tp} pp{pp} ep{ep}"] = \
            _export_diff(cfg, root / "mcore", original, tp, pp, ep)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            report["hf_logits"] = hf(_tokens(cfg.vocab_size)[:, :-1]).logits.float()
    return report


def launch() -> list[dict]:
    from tests.distributed import run_ranks

    with tempfile.TemporaryDirectory(prefix="moe_ranks_") as root:
        return run_ranks(4, _rank_main, root, timeout=900)
