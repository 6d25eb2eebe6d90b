"""Test entry for tests/integration/test_launch.py: stands in for a trainer that resumes by itself.

Launched by launch/slurm/grpo.sbatch (ENTRY=tests/scripts/launch_resume.py), one rank.
With no checkpoint in ``--checkpoint.dir`` it writes one, prints "saved", and waits
to be requeued. When a checkpoint is there (the requeued attempt: same job id, so
same run directory) it prints "resumed" with the checkpoint's content and exits 0.
"""
import os
import sys
import time
from pathlib import Path

from grpo_mega.config import cli_config


def main() -> int:
    cfg = cli_config(sys.argv[1:])
    ckpt = Path(cfg.checkpoint.dir) / "latest.txt"
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    if ckpt.exists():
        print(f"[launch_resume] attempt {attempt} resumed from {ckpt}: {ckpt.read_text()}", flush=True)
        return 0
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_text(f"step 7 of job {os.environ.get('SLURM_JOB_ID')} attempt {attempt}")
    print(f"[launch_resume] attempt {attempt} saved {ckpt}", flush=True)
    time.sleep(600)
    return 1


if __name__ == "__main__":
    sys.exit(main())
