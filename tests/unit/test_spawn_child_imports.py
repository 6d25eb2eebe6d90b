"""What a spawn child of a training rank imports before it runs its target.

Every ``multiprocessing`` spawn child of a rank (a reward worker, megatron's checkpoint
writer, a child vLLM engine) first runs the rank's main module, ``grpo_mega.train``, as
``__mp_main__``; its target then arrives by pickle from the module that defines it.
"""
from __future__ import annotations

import subprocess
import sys

from tests import REPO

PROBE = ("import runpy, sys; runpy.run_module('grpo_mega.train', run_name='__mp_main__'); "
         "print(sorted(m for m in ('torch', 'grpo_mega.trainer', 'triton') if m in sys.modules))")


def test_spawn_child_of_a_rank_does_not_import_the_trainer():
    """Guards against start-up cost coming back to every spawn child: ``grpo_mega.train``
    run as ``__mp_main__`` loading torch, the trainer stages and triton (about 1-1.5
    CPU-seconds per child, a few children per rank, every launch of a run and of the test
    suite) though no child's target needs them. Run as ``__mp_main__``, it must leave
    torch, ``grpo_mega.trainer`` and triton unimported."""
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
