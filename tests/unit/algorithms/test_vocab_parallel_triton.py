"""The fused Triton log-prob + entropy kernel computes what grpo_mega.algorithms computes.

Each comparison is against two references: ``grpo_mega.algorithms`` on the same shard
(``mask_vocab_padding(z).float() / T``, what the unfused update uses) and a float64
full-vocabulary ``log_softmax`` of the unsharded logits, values and gradients both.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; that needs
``TRITON_INTERPRET=1`` before Triton is imported, so those checks run in a fresh
interpreter process (and, for TP=2, in two gloo ranks spawned from it). On a GPU
the same comparison runs on CUDA tensors at a realistic size.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import REPO
from tests.compare import max_abs_diff, max_abs_diff_all, worst

ROOT = REPO


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def _compare(tp: int, rank: int, tp_group, *, device: str, dtype: torch.dtype, b: int, s: int,
             v_pad: int, vocab: int, temperature: float, block=None, seed: int = 0) -> dict:
    """Max abs differences of the fused kernel against both references on this rank's shard."""
    from grpo_mega import algorithms as A
    from grpo_mega.algorithms.vocab_parallel_triton import fused_logprobs_entropy
    from grpo_mega.models import mask_vocab_padding

    g = torch.Generator().manual_seed(seed)
    # Rounded to the tested dtype first, so the fp64 reference sees the same inputs.
    full = (torch.randn(b, s + 1, v_pad, generator=g, dtype=torch.float64) * 3).to(dtype).double()
    targets = torch.randint(0, vocab, (b, s), generator=g)
    # Put targets in every shard, so the cross-shard target path is exercised.
    targets[0, : min(s, tp)] = torch.tensor([min(r * (v_pad // tp), vocab - 1) for r in range(min(s, tp))])
    w_lp = torch.randn(b, s, generator=g, dtype=torch.float64)
    w_ent = torch.randn(b, s, generator=g, dtype=torch.float64)
    shard = v_pad // tp
    cols = slice(rank * shard, (rank + 1) * shard)
    t = temperature if temperature not in (0.0, 1.0) else 1.0

    # float64 full-vocab reference
    z64 = full[:, :-1].clone().requires_grad_()
    logq = torch.log_softmax(z64[..., :vocab] / t, dim=-1)
    lp64 = logq.gather(-1, targets[..., None]).squeeze(-1)
    ent64 = -(logq.exp() * logq).sum(-1)
    ((lp64 * w_lp).sum() + (ent64 * w_ent).sum()).backward()
    g64 = z64.grad[..., cols]

    def run(fn):
        leaf = full[..., cols].to(device=device, dtype=dtype).requires_grad_()
        lp, ent = fn(leaf)
        ((lp.double() * w_lp.to(device)).sum() + (ent.double() * w_ent.to(device)).sum()).backward()
        return lp.double().cpu(), ent.double().cpu(), leaf.grad[:, :-1].double().cpu(), leaf.grad[:, -1]

    def fused(leaf):
        return fused_logprobs_entropy(leaf[:, :-1], targets.to(device), tp_group,
                                      temperature=temperature, vocab_size=vocab, block=block)

    def unfused(leaf):
        z = mask_vocab_padding(leaf[:, :-1], vocab, rank).float() / t
        tg = targets.to(device)
        return A.vocab_parallel_logprobs(z, tg, tp_group), A.vocab_parallel_entropy(z, tp_group)

    f_lp, f_ent, f_g, f_last = run(fused)
    u_lp, u_ent, u_g, _ = run(unfused)
    scale = float(g64.abs().max()) or 1.0
    return {
        "lp_vs_unfused": float((f_lp - u_lp).abs().max()),
        "ent_vs_unfused": float((f_ent - u_ent).abs().max()),
        "grad_vs_unfused": float((f_g - u_g).abs().max()) / scale,
        "lp_vs_fp64": float((f_lp - lp64.detach()).abs().max()),
        "ent_vs_fp64": float((f_ent - ent64.detach()).abs().max()),
        "grad_vs_fp64": float((f_g - g64).abs().max()) / scale,
        "last_position_grad": float(f_last.abs().max()),  # outside the slice: must stay 0
        "padding_grad": float(f_g[..., max(vocab - rank * shard, 0):].abs().max()) if vocab < (rank + 1) * shard else 0.0,
    }


CASES = {
    # name: (tp, dtype, b, s, v_pad, vocab, temperature, block, value tol,
    #        grad tol relative to max |grad|). block=16 walks the vocab in several blocks,
    #        so the online max is rescaled when a later block holds a larger logit.
    "tp1_fp32_T0.7_padding_one_block": (1, torch.float32, 3, 5, 100, 90, 0.7, None, 2e-6, 2e-6),
    "tp1_fp32_many_blocks": (1, torch.float32, 3, 4, 100, 90, 1.0, 16, 2e-6, 2e-6),
    "tp1_bf16_many_blocks": (1, torch.bfloat16, 2, 4, 96, 96, 1.0, 16, 2e-6, 2 ** -7),
    "tp2_fp32_targets_in_both_shards": (2, torch.float32, 2, 5, 128, 100, 1.0, 16, 2e-6, 2e-6),
    "tp2_fp32_shard_all_padding": (2, torch.float32, 2, 3, 128, 60, 0.5, None, 2e-6, 2e-6),
}


def _rank_fn(rank, world, case):
    import torch.distributed as dist
    tp, dtype, b, s, v_pad, vocab, temp, block, *_ = CASES[case]
    return _compare(tp, rank, dist.group.WORLD, device="cpu", dtype=dtype, b=b, s=s,
                    v_pad=v_pad, vocab=vocab, temperature=temp, block=block)


def _update_rank(rank, world):
    """One GRPO update of a TP=2 megatron model through the pipeline schedule, with the
    torch path and with the fused kernel, from the same weights: old log-probs, loss,
    metrics and the reduced gradients must agree."""
    import copy
    from grpo_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.passes import compute_logprobs, metrics_to_floats, update_policy
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.distributed.state import init_parallel

    class Recording(ParallelAdamW):
        def step(self, reduce=True):
            self.reduce_grads()
            self.grads = [p.grad.clone() for p in self.main]
            return super().step(reduce=False)

    ps = init_parallel(2, 1, seed=5)
    # vocab 50 pads to 64: rank 1's shard holds 18 real columns and 14 of padding.
    m = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=96, make_vocab_size_divisible_by=4)
    g = torch.Generator().manual_seed(1)
    prompts, resps, rlps = [], [], []
    for i in range(4):
        resp = torch.randint(0, 50, (3 + i,), generator=g).tolist()
        prompts.append(torch.randint(0, 50, (4,), generator=g).tolist())
        resps.append(resp)
        rlps.append((-torch.rand(len(resp), generator=g)).tolist())
    model = build_model(m, ps)
    start = copy.deepcopy(model.state_dict())
    runs = {}
    for fused in (False, True):
        model.load_state_dict(start)
        opt = Recording(model, OptimizerConfig(lr=1e-3), ps)
        batch = TrainingBatch.pack(prompts, resps, rlps, [(-1.0) ** i for i in range(4)], pad_id=0)
        batch.old_logp = batch.empty_logp()
        micro = batch.split(2)
        kw = dict(vocab_size=50, temperature=0.8, fused=fused)
        compute_logprobs(model, micro, ps, key="old_logp", **kw)
        metrics = metrics_to_floats(update_policy(model, opt, micro, ps, AlgorithmConfig(kl_coef=0.0),
                                                  max_len=8, reuse_current_as_old=False, **kw))
        runs[fused] = (batch.old_logp[batch.loss_mask], metrics, opt.grads)
    (lp0, m0, g0), (lp1, m1, g1) = runs[False], runs[True]
    scale = worst(float(x.abs().max()) for x in g0)
    return {"old_logp": max_abs_diff(lp0, lp1),
            "metrics": worst(abs(m0[k] - m1[k]) for k in m0 if k != "skipped"),
            "grads": max_abs_diff_all(list(g0), list(g1)) / scale,
            "grad_norm": m0["grad_norm"], "n_metrics": len(m0)}


def _interpreted_main() -> None:
    """Entry point of the TRITON_INTERPRET=1 child process: print every case's diffs."""
    import json
    from tests.distributed import run_ranks

    out = {}
    for case, (tp, dtype, b, s, v_pad, vocab, temp, block, *_) in CASES.items():
        if tp == 1:
            out[case] = [_compare(1, 0, None, device="cpu", dtype=dtype, b=b, s=s, v_pad=v_pad,
                                  vocab=vocab, temperature=temp, block=block)]
        else:
            out[case] = run_ranks(tp, _rank_fn, case, timeout=300)
    out["update_tp2"] = run_ranks(2, _update_rank, timeout=600)
    print("RESULT " + json.dumps(out))


def _check(results: dict) -> None:
    for case, per_rank in results.items():
        *_, vtol, gtol = CASES[case]
        for r, d in enumerate(per_rank):
            for key in ("lp_vs_unfused", "ent_vs_unfused", "lp_vs_fp64", "ent_vs_fp64"):
                tol = vtol if CASES[case][1] == torch.float32 or "unfused" in key else 2e-2
                assert d[key] <= tol, f"{case} rank {r}: {key} = {d[key]:.3g} > {tol}"
            for key in ("grad_vs_unfused", "grad_vs_fp64"):
                assert d[key] <= gtol, f"{case} rank {r}: {key} = {d[key]:.3g} > {gtol}"
            assert d["last_position_grad"] == 0.0 and d["padding_grad"] == 0.0, (case, r, d)


@pytest.mark.skipif(not _have_triton(), reason="triton is not installed (pip install triton)")
def test_fused_kernel_matches_algorithms_and_fp64_in_triton_interpreter():
    """Guards against a fused kernel whose values or gradients drift from the tested
    vocab-parallel math: wrong online-max rescaling, padding columns in the softmax,
    a shard that is all padding (NaN from -inf - -inf), the target in another shard,
    temperature applied to one path only, or a gradient written into the slice's
    neighbour (the logits[:, :-1] view); and against wiring that differs between the
    two paths in the GRPO update itself (a TP=2 megatron model through the schedule)."""
    import json
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", "from tests.unit.algorithms.test_vocab_parallel_triton import "
                           "_interpreted_main; _interpreted_main()"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    update = results.pop("update_tp2")
    assert set(results) == set(CASES)
    _check(results)
    for r, d in enumerate(update):
        assert d["grad_norm"] > 0 and d["n_metrics"] > 3, d
        assert d["old_logp"] < 1e-5 and d["metrics"] < 1e-5 and d["grads"] < 1e-5, (r, d)


def test_fused_kernel_refuses_cpu_tensors_outside_the_interpreter():
    """Guards against a silent fallback: asking for the fused kernel where it cannot run
    must say so and name the flag, not quietly compute something else."""
    if not _have_triton():
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode runs CPU tensors")
    from grpo_mega.algorithms.vocab_parallel_triton import fused_logprobs_entropy
    with pytest.raises(RuntimeError, match="--algorithm.logprob_kernel=torch"):
        fused_logprobs_entropy(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_kernel_matches_algorithms_on_gpu():
    """The same comparison on CUDA tensors at a realistic size (bf16 and fp32)."""
    results = {}
    for name, dtype in (("gpu_fp32", torch.float32), ("gpu_bf16", torch.bfloat16)):
        results[name] = [_compare(1, 0, None, device="cuda", dtype=dtype, b=4, s=512,
                                  v_pad=32768, vocab=32000, temperature=0.7)]
        CASES[name] = (1, dtype, 4, 512, 32768, 32000, 0.7, None, 2e-5,
                       2e-6 if dtype == torch.float32 else 2 ** -7)
    _check(results)


def test_gpu_ready_fused_kernels_compute_offsets_in_int64():
    """Guards against issue 27's defect 6: the kernels' row offsets (``row * n_cols``,
    ``row // rows_per_b * stride_b``) were int32, so a logits shard of 2^31 elements or more
    (e.g. 16k tokens x 152k/1 vocab) addressed wrong memory on a GPU. The CPU interpreter
    computes with Python ints and cannot show it, so the kernels' source is checked: every
    ``tl.program_id`` is widened with ``.to(tl.int64)`` before any offset is formed."""
    import ast

    src = (REPO / "grpo_mega" / "algorithms" / "vocab_parallel_triton.py").read_text()
    kernels = [f for f in ast.walk(ast.parse(src)) if isinstance(f, ast.FunctionDef)
               and any("jit" in ast.unparse(d) for d in f.decorator_list)]
    assert {k.name for k in kernels} >= {"_stats_kernel", "_grad_kernel"}
    for k in kernels:
        parents = {id(c): p for p in ast.walk(k) for c in ast.iter_child_nodes(p)}
        ids = [n for n in ast.walk(k) if isinstance(n, ast.Call) and ast.unparse(n.func) == "tl.program_id"]
        assert ids, k.name
        for call in ids:
            up = parents[id(call)]
            widened = (isinstance(up, ast.Attribute) and up.attr == "to"
                       and isinstance(parents[id(up)], ast.Call)
                       and ast.unparse(parents[id(up)].args[0]) == "tl.int64")
            assert widened, f"{k.name}: {ast.unparse(parents[id(call)])} stays int32"
