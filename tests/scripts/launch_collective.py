"""Test entry for tests/integration/test_launch.py: join the world, then block in a collective.

Launched through launch/torchrun.sh with ENTRY=tests/scripts/launch_collective.py.
It takes the trainer's config flags (``--parallel.timeout_minutes`` sets the
collective timeout) and avoids megatron so that it starts in a few seconds.
Every rank all-reduces once (proving the rendezvous) and prints a ready line.
Then ranks started with LAUNCH_COLLECTIVE_ROLE=victim sleep (the test kills their
node), and the others wait in a second all-reduce that the victims never join:
they must fail within the timeout instead of hanging.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from grpo_mega.runtime import lifeline
from grpo_mega.config import cli_config


def main() -> int:
    cfg = cli_config(sys.argv[1:])
    lifeline.watch_parent("torchrun agent", label=f"rank {os.environ.get('RANK')}")  # as the trainer
    dist.init_process_group("gloo", timeout=timedelta(minutes=cfg.parallel.timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"[launch_collective] rank {rank}/{world} ready (sum {int(t.item())}) pid {os.getpid()}",
          flush=True)
    if os.environ.get("LAUNCH_COLLECTIVE_ROLE") != "victim":
        t0 = time.time()
        try:
            dist.all_reduce(t)  # the victims never join this one
        except Exception as e:  # noqa: BLE001 - report and fail like a trainer would
            print(f"[launch_collective] rank {rank} collective failed after {time.time() - t0:.1f}s: "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            return 3
        return 0
    time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
