"""vLLM's CPU shared-memory segments: stale ones cleared, live ones kept, names job-scoped."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

from grpo_mega.rollout import cpu_shm


def test_restart_clears_only_segments_no_live_process_maps(tmp_path):
    """Guards against a leaked shm segment of a killed engine blocking the restart (errno 17)
    and against the opposite bug, unlinking the segments of a job that is still running:
    of two ``*cpushm*`` files, the one a live process maps must stay, the other must go."""
    live, dead, other = tmp_path / "-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1", tmp_path / "x"
    for p in (live, dead, other):
        p.write_bytes(b"\0" * mmap.PAGESIZE)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import mmap,sys,time\n"
         f"f=open({str(live)!r},'r+b'); m=mmap.mmap(f.fileno(), 0); f.close()\n"
         "print('mapped', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert [p.name for p in cpu_shm.stale_segments(tmp_path)] == [dead.name]
        assert cpu_shm.clear_stale_segments(tmp_path) == [dead.name]
        assert live.exists() and other.exists() and not dead.exists()
    finally:
        holder.kill()
        holder.wait()
    deadline = time.time() + 5
    while live.exists() and time.time() < deadline:  # its owner is dead now: stale
        cpu_shm.clear_stale_segments(tmp_path)
    assert not live.exists() and other.exists()


def test_restart_segment_names_are_job_scoped_and_valid_posix_shm_names():
    """Guards against two jobs on one machine sharing segment names (vLLM's ``env://``
    identifier gives every job ``//-tp:0-[0-1]-cpushm``), and against a scoped name that
    keeps vLLM's slashes, which ``shm_open`` refuses."""
    a = cpu_shm.scoped_name("0a1b2c3d", "//-tp:0-[0-1]-cpushm")
    b = cpu_shm.scoped_name("ffff0000", "//-tp:0-[0-1]-cpushm")
    assert a != b and "/" not in a and a.startswith("grpo-0a1b2c3d-") and a.endswith("-tp:0-[0-1]-cpushm")


def test_restart_removes_weight_files_of_dead_writers_only(tmp_path):
    """Guards against a trainer SIGKILLed mid-sync in ``child`` engine mode leaking its
    weight file in /dev/shm for good (a bucket of weights in RAM per kill), and against the
    clean-up removing the file of a live job's sync in flight."""
    from grpo_mega.rollout.worker import WEIGHT_FILE_PREFIX, clear_dead_weight_files, write_weight_file
    import torch

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{WEIGHT_FILE_PREFIX}{dead.pid}_x.safetensors"
    stale.write_bytes(b"x")
    with write_weight_file([("w", torch.zeros(2))], str(tmp_path)) as live:
        assert clear_dead_weight_files(str(tmp_path)) == [stale.name]
        assert Path(live).exists() and Path(live).name.startswith(f"{WEIGHT_FILE_PREFIX}{os.getpid()}_")
    assert list(tmp_path.iterdir()) == []


def test_oversubscribed_when_this_machine_has_more_ranks_than_cores(monkeypatch):
    """Guards against vLLM's spinning shared-memory all-reduce kept where ranks outnumber the
    cores (a 4-rank engine on 2 cores: 167-321 CPU-s for a 2-step test, 73 with gloo), and
    against dropping it where every rank has a core (its segments are then what the engine
    uses, and what the restart clean-up is tested on)."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    assert cpu_shm.oversubscribed()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert not cpu_shm.oversubscribed()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not cpu_shm.oversubscribed()
