"""vLLM's CPU shared-memory segments: one name per job, and the leftovers of killed jobs removed.

On CPU, a vLLM engine with tensor parallelism >= 2 exchanges activations through
shared-memory segments in ``/dev/shm`` (``cpu_communicator._CPUSHMDistributed``). vLLM
names them ``{VLLM_DIST_IDENT}-{group}-[ranks]-cpushm_N`` and creates them with
``O_EXCL``. Under ``external_launcher`` the identifier comes from the init method
``env://``, so every job on a machine uses the same names (``-tp:0-[0-1]-cpushm_0``).
An engine that is SIGKILLed (OOM killer, preemption, a Slurm time limit) never unlinks
its segments, and from then on every TP >= 2 engine on that machine failed at start with
``create shm in SHMManager failed. errno: 17``.

We do both things that matter, before each engine starts:

* **one name per job** (``job_scoped_names``): rank 0 draws a random job id, every rank
  receives it, and the segment names carry it (``grpo-<id>-tp:0-[0-1]-cpushm_0``). Two
  jobs on one machine, or a restart next to a dying predecessor, cannot collide;
* **stale segments are removed** (``clear_stale_segments``): a ``*cpushm*`` segment of
  this user that no live process maps or holds open belonged to a killed job (a live
  engine keeps its segments mapped for its whole life), so it is unlinked. This keeps a
  killed job from leaking RAM in ``/dev/shm`` for good.

None of this runs on GPU, where vLLM uses NCCL and no such segments exist.
"""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Iterable, Optional

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "grpo-"
"""Our names start with this, so the leak check of the tests can tell them apart."""
SHM_TAG_ENV = "GRPO_MEGA_SHM_TAG"


def _referenced_shm_names(shm_dir: Path) -> set[str]:
    """Names of the files in ``shm_dir`` that some readable process maps or holds open."""
    names: set[str] = set()
    prefix = str(shm_dir).rstrip("/") + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                i = line.find(prefix)
                if i >= 0:
                    names.add(line[i + len(prefix):].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    names.add(target[len(prefix):].removesuffix(" (deleted)"))
        except OSError:  # the process exited, or is another user's
            continue
    return names


def stale_segments(shm_dir: Path = SHM_DIR, match=lambda name: "cpushm" in name) -> list[Path]:
    """Files in ``shm_dir`` of this user whose name ``match``es (default: vLLM's CPU
    segments, ``*cpushm*``) that no live process maps or holds open."""
    try:
        candidates = [p for p in shm_dir.iterdir()
                      if match(p.name) and p.is_file() and p.stat().st_uid == os.getuid()]
    except OSError:
        return []
    if not candidates:
        return []
    live = _referenced_shm_names(shm_dir)
    return [p for p in candidates if p.name not in live]


def clear_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments ``stale_segments`` finds; returns their names. Safe to call on
    every rank at once (a name already gone is skipped)."""
    removed = []
    for p in stale_segments(shm_dir):
        try:
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("rollout: cannot remove the stale vLLM segment %s (%s)", p, e)
    if removed:
        log.warning("rollout: removed %d shared-memory segment(s) a killed vLLM engine left in %s: %s",
                    len(removed), shm_dir, ", ".join(sorted(removed)))
    return removed


def agreed_job_id(rank_zero_id: Optional[str] = None) -> str:
    """A random id drawn on global rank 0 and received by every rank (collective over the
    default group when one is initialised; a fresh id otherwise)."""
    import torch.distributed as dist

    # GRPO_MEGA_SHM_TAG (hex; the test session sets it) lets a leak check tell its own
    # segments from those of other jobs on the machine.
    mine = rank_zero_id or (os.environ.get(SHM_TAG_ENV, "") + secrets.token_hex(4))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    box = [mine if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def scoped_name(job_id: str, vllm_name: str) -> str:
    """``grpo-<job>`` + vLLM's name, without the slashes its ``env://`` identifier leaves
    (``//-tp:0-[0-1]-cpushm``): POSIX shm names may hold no slash after the first."""
    return f"{PREFIX}{job_id}-" + vllm_name.replace("/", "")


def oversubscribed() -> bool:
    """More ranks on this machine (torchrun's LOCAL_WORLD_SIZE) than cores this process may use."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > len(os.sched_getaffinity(0))


def job_scoped_names(job_id: str) -> bool:
    """Make vLLM's CPU communicator name its segments after ``job_id`` (in this process;
    the engine's workers live here in ``external_launcher`` mode), and, where this machine
    has more ranks than cores (``oversubscribed``), not use the segments at all (gloo
    instead, below). Returns False, and changes nothing, where this vLLM has no such
    communicator (GPU builds, other versions)."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator as cc
    except Exception:  # noqa: BLE001 - a vLLM without the CPU communicator has no segments
        return False
    cls = getattr(cc, "_CPUSHMDistributed", None)
    original = getattr(cls, "_grpo_vllm_make_group_name", None) or getattr(cls, "make_group_name", None)
    if cls is None or original is None:
        return False
    if oversubscribed():
        # Its all-reduce waits by spinning on the segment: with more ranks than cores a rank
        # spins until its peer is scheduled (a 4-rank engine on 2 cores: 167-321 CPU-s for a
        # 2-step test, 73 with gloo, which blocks). vLLM's own fallback then takes over.
        cc.CpuCommunicator._all_group_ranks_share_shm_group_name = lambda self: False
    cls._grpo_vllm_make_group_name = original
    cls.make_group_name = staticmethod(lambda communicator: scoped_name(job_id, original(communicator)))
    return True


def segments_of(job_id: str, shm_dir: Path = SHM_DIR) -> Iterable[Path]:
    """The segments in ``shm_dir`` named after ``job_id``."""
    return sorted(shm_dir.glob(f"{PREFIX}{job_id}-*"))
