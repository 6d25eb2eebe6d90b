"""The update's loss from the raw logits shard, read ``chunk_size`` tokens at a time with the
padding mask and temperature applied per block (``micro_loss``), against the previous
full-shard path: ``mask_vocab_padding(logits[:, :-1]) / T`` materialised, then the
vocab-parallel functions over that copy in one block. float64 logits, TP=1 and TP=2.

Loss, log-probs, entropy and the exact KL are compared bit for bit. The gradient w.r.t. the
raw logits is bit for bit too when one function consumes them (kl_kind k3); with
``kl_kind: full`` the log-prob and KL gradients are each scaled by 1/T before autograd adds
them (the copy added them first), so they are compared to 1e-13 relative.

One launch of 2 ranks runs every check (TP=2 on the world, TP=1 with no group on each rank).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.distributed import run_ranks
from tests.unit.trainer.test_batch import _batch

VOCAB, V_PAD = 50, 64  # at TP=2 rank 1's shard is columns 32..63: 14 padding columns
CHUNKS = (None, 4, 5, 1000)
TEMPS = (1.0, 0.7)
CHECKS = ("loss", "logp", "metrics", "grad", "grad_zero_off_grid")  # per (kind, T, chunk)


def _ps(group):
    import torch.distributed as dist

    from grpo_mega.distributed.state import ParallelState

    tp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    return ParallelState(rank=rank, world_size=tp, tp=tp, pp=1, dp=1, tp_rank=rank, pp_rank=0,
                         dp_rank=0, tp_group=group, pp_group=None, dp_group=None, mp_group=None,
                         embedding_group=None, device=torch.device("cpu"))


def _previous_path(logits, ref_logits, mb, ps, algo, temperature, counts):
    """The update before per-block transforms: a masked, scaled copy of the whole shard
    (``mask_vocab_padding(logits[:, :-1]) / T``) fed to the functions in one block."""
    from grpo_mega import algorithms as A
    from grpo_mega.models import mask_vocab_padding

    def target(x):
        z = mask_vocab_padding(x[:, :-1], VOCAB, ps.tp_rank)
        return z / temperature if temperature not in (0.0, 1.0) else z

    z = target(logits)
    logp = A.vocab_parallel_logprobs(z, mb.targets, ps.tp_group)
    with torch.no_grad():
        ent = A.vocab_parallel_entropy(z.detach(), ps.tp_group)
    kl = A.exact_kl(algo.kl_kind, z, target(ref_logits), ps.tp_group) if ref_logits is not None else None
    loss, m = A.policy_loss(logp, logp.detach(), mb.advantages, mb.loss_mask,
                            clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
                            ref_logp=mb.ref_logp if kl is None else None, kl_coef=algo.kl_coef,
                            kl_kind=algo.kl_kind, kl=kl, entropy=ent, max_len=8,
                            global_tokens=counts[0], global_seqs=counts[1])
    return loss, m, logp, ent, kl


def _checks(group) -> dict:
    from grpo_mega import algorithms as A
    from grpo_mega.config import AlgorithmConfig
    from grpo_mega.trainer.passes import micro_loss

    ps = _ps(group)
    b = _batch()
    g = torch.Generator().manual_seed(3)
    n, s = b.tokens.shape
    full = torch.randn(n, s, V_PAD, generator=g, dtype=torch.float64) * 3
    ref_full = full + torch.randn(n, s, V_PAD, generator=g, dtype=torch.float64)
    b.ref_logp = -torch.rand(n, s - 1, generator=g, dtype=torch.float64).float()
    width = V_PAD // ps.tp
    shard = full[..., ps.tp_rank * width:(ps.tp_rank + 1) * width]
    ref_shard = ref_full[..., ps.tp_rank * width:(ps.tp_rank + 1) * width].contiguous()
    counts = (int(b.loss_mask.sum()), n)
    res = {}
    # Logits near the padding value (-1e4 for fp64) give the padded columns real probability,
    # so a gradient left on them would show (at ordinary scales it underflows to 0).
    near_pad = shard - 1e4
    for key, x0 in (("k3_nearpad", near_pad),):
        algo = AlgorithmConfig(kl_coef=0.3, kl_kind="k3")
        x0 = x0.clone().requires_grad_()
        _previous_path(x0, None, b, ps, algo, 0.7, counts)[0].backward()
        x = near_pad.clone().requires_grad_()
        micro_loss(x, b, ps, algo, vocab_size=VOCAB, temperature=0.7, max_len=8,
                   reuse_current_as_old=True, global_tokens=counts[0], global_seqs=counts[1],
                   chunk_size=4, all_positions=True)[0].backward()
        res[f"{key}_grad"] = bool(torch.equal(x.grad, x0.grad))
    for kind in ("k3", "full"):
        algo = AlgorithmConfig(kl_coef=0.3, kl_kind=kind, clip_low=0.2, clip_high=0.28)
        ref = ref_shard if A.kl_needs_logits(kind) else None
        for temp in TEMPS:
            x0 = shard.clone().requires_grad_()
            loss0, m0, logp0, ent0, kl0 = _previous_path(x0, ref, b, ps, algo, temp, counts)
            loss0.backward()
            for chunk in CHUNKS:
                x = shard.clone().requires_grad_()
                loss, m, logp = micro_loss(x, b, ps, algo, ref_logits=ref, vocab_size=VOCAB,
                                           temperature=temp, max_len=8, reuse_current_as_old=True,
                                           global_tokens=counts[0], global_seqs=counts[1],
                                           chunk_size=chunk, all_positions=True)
                loss.backward()
                key = f"{kind}_T{temp}_chunk{chunk}"
                res[f"{key}_loss"] = bool(torch.equal(loss, loss0))
                res[f"{key}_logp"] = bool(torch.equal(logp.detach(), logp0.detach()))
                res[f"{key}_metrics"] = len(m0) > 0 and all(
                    torch.equal(torch.as_tensor(m[k]), torch.as_tensor(m0[k])) for k in m0)
                if kind == "full":
                    res[f"{key}_grad"] = bool(torch.allclose(x.grad, x0.grad, rtol=1e-13, atol=1e-16))
                else:
                    res[f"{key}_grad"] = bool(torch.equal(x.grad, x0.grad))
                # no gradient may reach the padding columns or the last position
                pad_cols = max(0, (ps.tp_rank + 1) * width - VOCAB)
                res[f"{key}_grad_zero_off_grid"] = bool(
                    (x.grad[:, -1] == 0).all() and (pad_cols == 0 or (x.grad[..., width - pad_cols:] == 0).all()))
    return res


def _rank(rank, world):
    import torch.distributed as dist

    return {"tp2": _checks(dist.group.WORLD), "tp1": _checks(None)}


@functools.lru_cache(maxsize=None)
def _launch():
    return run_ranks(2, _rank, timeout=300)


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("kind", ["k3", "full"])
def test_per_block_sampling_transform_equals_the_full_shard_copy(tp, kind):
    """Guards against the per-block transform drifting from the copy it replaced: the
    temperature applied twice or not at all in some block (or in the backward), the padding
    columns left unmasked on the rank that holds them, the last position's logits leaking
    into the loss, or a gradient on padding columns. Loss, log-probs and metrics must be
    bitwise those of ``mask_vocab_padding(logits[:, :-1]) / T`` for every chunk size."""
    ran = len(CHECKS) * len(TEMPS) * len(CHUNKS) + (kind == "k3")  # + the near-padding gradient
    results = _launch()
    assert len(results) == 2, len(results)
    for rank, res in enumerate(results):
        mine = {k: ok for k, ok in res[tp].items() if k.startswith(kind)}
        assert len(mine) == ran, f"rank {rank}: {len(mine)} checks ran, not {ran}: {sorted(mine)}"
        bad = [k for k, ok in mine.items() if not ok]
        assert not bad, f"rank {rank}: {bad}"
