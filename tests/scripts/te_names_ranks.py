"""One 2-rank gloo launch that builds models through megatron's Transformer Engine layer spec
on CPU (tests/unit/models/test_te_names.py).

``tests/te_stub`` stands in for Transformer Engine: megatron's own spec provider, wrappers and
sharded state dicts run unchanged, and only the TE base modules are reduced to their
parameters. Per family (dense Llama and Qwen2, QK-norm Qwen3, grouped-GEMM Qwen3-MoE) and
layout, every rank reports:
  * ``names``: the TE model's parameter names and sharded-state keys (rank 0, first layout);
  * ``export``: an HF checkpoint converted with ``hf_to_mcore``, loaded into the TE model with
    ``load_mcore_weights`` and exported by the bridge, against the original tensors;
  * ``hf_load``: ``load_hf_weights`` into a second TE model equals that load;
  * ``te_to_local``: the TE model's own checkpoint (as the trainer saves it) loaded into a
    local-spec model, exported, against the original (a GPU checkpoint resumed on CPU);
  * ``local_to_te``: the same the other way (a CPU checkpoint resumed on a GPU);
  * ``te_to_hf``: ``mcore_to_hf`` of the TE model's checkpoint against the original.
Each check is a list of what differs (empty when right).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

VARIANTS = {"llama": ("llama", False), "qwen2": ("qwen2", True), "qwen3": ("qwen3", False),
            "qwen3_moe": ("qwen3_moe", False)}
# (tp, ep) per variant at world 2; names are taken at the first (EP 1: every expert local)
LAYOUTS = {"llama": [(2, 1)], "qwen2": [(2, 1)], "qwen3": [(2, 1)], "qwen3_moe": [(2, 1), (1, 2)]}


def _reinit(tp: int, ep: int):
    from megatron.core import parallel_state as mpu

    from grpo_mega.distributed.state import init_parallel
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    return init_parallel(tp, 1, ep=ep, seed=3)


def _diff(want: dict, got: dict) -> list[str]:
    bad = [f"missing: {n}" for n in sorted(set(want) - set(got))]
    bad += [f"extra: {n}" for n in sorted(set(got) - set(want))]
    return bad + [f"differs: {n}" for n in sorted(set(want) & set(got)) if not torch.equal(want[n], got[n])]


def _export(model, cfg, ps) -> dict:
    from grpo_mega.bridge.export import export_hf_weights
    return {n: t.clone() for n, t in export_hf_weights(model, cfg, ps, bucket_bytes=64 * 1024)}


def _save(model, ps, path: Path) -> Path:
    """The model part of a trainer checkpoint (trainer_state saves the same sharded dict)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from grpo_mega.models.gpt import sharded_state_dict
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True)
    torch.distributed.barrier()
    sd = {k: v for k, v in sharded_state_dict(model, ps).items() if not isinstance(v, ShardedObject)}
    dist_checkpointing.save(sd, str(path))
    return path


def _checked(report: dict, key: str, check) -> None:
    """report[key] = check() (a list of what differs), or the error it raised: a broken step
    fails its own test, and the launch goes on (every rank fails alike, so collectives pair)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        report[key] = check()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported to the test
        report[key] = [f"{type(e).__name__}: {str(e)[:500]}"]


def _layout(cfg, root: Path, hf_dir: Path, mcore: Path, original: dict, tag: str, tp: int, ep: int,
            report: dict) -> None:
    from grpo_mega.checkpoint.convert import load_hf_weights, load_mcore_weights, mcore_to_hf
    from grpo_mega.models.gpt import build_model, sharded_state_dict
    from tests.scripts.bridge_fixtures import read_hf_tensors

    ps = _reinit(tp, ep)
    # fresh models per load: a load that silently skipped a tensor would otherwise pass
    te, other, fresh, local = (build_model(cfg, ps, use_te=use_te) for use_te in (True, True, True, False))
    if f"names {tag.split()[0]}" not in report and torch.distributed.get_rank() == 0:
        report[f"names {tag.split()[0]}"] = {
            "cfg": cfg, "params": [n for n, _ in te.named_parameters()],
            "keys": sorted({getattr(v, "key", k) for k, v in sharded_state_dict(te, ps).items()})}

    def export():
        load_mcore_weights(te, mcore, ps, cfg)
        return _diff(original, _export(te, cfg, ps))

    def hf_load():
        load_hf_weights(other, hf_dir, ps, cfg)
        theirs = dict(other.named_parameters())
        return [n for n, p in te.named_parameters() if not torch.equal(p, theirs[n])]

    def te_to_local():
        load_mcore_weights(local, _save(te, ps, root / f"te {tag}"), ps, cfg)
        return _diff(original, _export(local, cfg, ps))

    def local_to_te():
        load_mcore_weights(fresh, _save(local, ps, root / f"local {tag}"), ps, cfg)
        return _diff(original, _export(fresh, cfg, ps))

    def te_to_hf():
        back = mcore_to_hf(root / f"te {tag}", root / f"back {tag}", hf_config_dir=hf_dir, progress=None)
        return _diff(original, read_hf_tensors(back))

    for key, check in (("export", export), ("hf_load", hf_load), ("te_to_local", te_to_local),
                       ("local_to_te", local_to_te), ("te_to_hf", te_to_hf)):
        _checked(report, f"{key} {tag}", check)


def _rank_main(rank: int, world: int, root: str) -> dict:
    from tests import te_stub
    te_stub.activate()  # before megatron is imported in this process

    from grpo_mega.checkpoint import convert
    from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint

    report: dict = {}
    for name, (family, tie) in VARIANTS.items():
        base = Path(root) / name
        hf_dir = base / "hf"
        if rank == 0:
            write_hf_checkpoint(hf_dir, family, tie=tie, seed=7, hidden_size=64, num_heads=2,
                                num_kv_heads=1, intermediate_size=96, vocab_size=200)
        torch.distributed.barrier()
        convert.hf_to_mcore(hf_dir, base / "mcore", progress=None)
        cfg = convert.read_model_config(base / "mcore")
        original = read_hf_tensors(hf_dir)
        for tp, ep in LAYOUTS[name]:
            _layout(cfg, base, hf_dir, base / "mcore", original, f"{name} tp{tp} ep{ep}", tp, ep, report)
    return report


def launch() -> list[dict]:
    from tests.distributed import run_ranks

    with tempfile.TemporaryDirectory(prefix="te_names_") as root:
        return run_ranks(2, _rank_main, root, timeout=900, fresh=True)  # te_stub before megatron


if __name__ == "__main__":
    import json
    reports = launch()
    print(json.dumps({k: v for k, v in reports[0].items() if not k.startswith("names")}, indent=1))
