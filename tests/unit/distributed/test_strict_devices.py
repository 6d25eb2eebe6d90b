"""The CPU suite's stand-in for NCCL's device rule (grpo_mega/distributed/strict_devices.py).

On a GPU job every group is NCCL, and a host tensor in a collective raises
``No backend type associated with device type cpu``; gloo on CPU accepts it, so without
this check the whole class of bug (issue 27, defect 1) hides from the suite.
"""
from __future__ import annotations

from tests.distributed import run_ranks


def _strict_rules(rank, world):
    import os

    import torch
    import torch.distributed as dist

    from grpo_mega.distributed import strict_devices as S
    from grpo_mega.trainer.dynamic_sampling import need_more_groups

    assert S.enabled(), "run_ranks must enable the strict device check"
    cpu = torch.device("cpu")
    out = {}

    def rejects(fn) -> str:
        try:
            fn()
        except RuntimeError as e:
            return str(e)
        return ""

    # grpo_mega code that makes its collective tensor without device= (defect 1's pattern).
    out["grpo_mega_host"] = rejects(lambda: need_more_groups(1, 4, 1, 4, dist.group.WORLD, None))
    out["grpo_mega_device"] = need_more_groups(1, 4, 1, 4, dist.group.WORLD, cpu)
    # Tensors made here (not grpo_mega) stay untagged, like megatron's and vLLM's own.
    mine = torch.ones(2)
    out["foreign_untagged"] = S.site_of(mine) is None
    # Treat this file as grpo_mega code to check the tagging rules themselves.
    S._PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
    host = torch.tensor([1.0, 2.0])
    derived = host.double() * 2
    moved = host.to(cpu)
    made_on_device = torch.zeros(2, device=cpu)
    mixed = host + made_on_device
    acc = torch.zeros((), device=cpu)
    acc += host.sum()  # in place: a device accumulator stays a device tensor
    out["tags"] = [S.site_of(t) is not None for t in (host, derived, moved, made_on_device, mixed, acc,
                                                      host.cpu(), moved.cpu())]
    out["site"] = S.site_of(host)
    out["all_reduce"] = rejects(lambda: dist.all_reduce(derived))
    out["all_gather"] = rejects(lambda: dist.all_gather([torch.empty_like(made_on_device)] * world, host))
    out["broadcast"] = rejects(lambda: dist.broadcast(host, src=0))
    dist.all_reduce(moved)
    dist.all_reduce(mixed)
    dist.all_reduce(acc)
    box = [host]
    dist.broadcast_object_list(box, src=0)  # objects are pickled: exempt
    # The error being imitated: a group whose only backend serves cuda tensors (as NCCL).
    cuda_only = dist.new_group([0, 1], backend="cuda:gloo")
    out["real"] = rejects(lambda: dist.all_reduce(made_on_device, group=cuda_only))
    return out


def test_strict_devices_rejects_host_tensors_in_collectives_like_nccl():
    """Guards against host (CPU) tensors handed to collectives, which die on a GPU job's
    NCCL groups ("No backend type associated with device type cpu") but pass on gloo:
    every multi-rank test runs with the check, which must reject a tensor grpo_mega made
    without device= (and anything computed only from such tensors), and must pass tensors
    made on or moved to the job's device, foreign tensors and object collectives."""
    r0, r1 = run_ranks(2, _strict_rules, timeout=120)
    for r in (r0, r1):
        assert "No backend type associated with device type cpu" in r["real"]  # torch's own
        assert "No backend type associated with device type cpu" in r["grpo_mega_host"]
        assert "dynamic_sampling.py" in r["grpo_mega_host"]
        assert r["grpo_mega_device"] == (True, 2)
        assert r["foreign_untagged"]
        assert r["tags"] == [True, True, False, False, False, False, True, True]
        assert r["site"].endswith(".py:" + r["site"].rsplit(":", 1)[1]) and "test_strict_devices" in r["site"]
        for k in ("all_reduce", "all_gather", "broadcast"):
            assert "test_strict_devices.py" in r[k], (k, r[k])
