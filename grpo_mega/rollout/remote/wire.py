"""What travels between the controller and an engine server, and how.

Two channels per engine:

* **control**: a ``multiprocessing.connection`` (TCP, loopback by default, HMAC-authenticated
  with the key in ``AUTHKEY_ENV``) carrying JSON objects only (``send_bytes``/``recv_bytes``
  of UTF-8 JSON; never pickle: ``Connection.send``/``recv`` would unpickle whatever a peer
  sends). Every message is a dict with an ``"op"``.
* **weights**: a torch.distributed process group built from a ``TCPStore`` (controller =
  rank 0, engine k = rank 1 + k): gloo on CPU, NCCL on GPU. The group object is constructed
  directly (``ProcessGroupGloo(store, rank, size, ...)``), never through
  ``init_process_group``: the trainer's default world is megatron's and must stay so, and an
  engine's vLLM must not find a default group to reuse. Collectives are called on the
  backend object (``pg.broadcast([t], opts).wait()``).

A bucket of HF-named tensors is sent as one JSON header (names, dtypes, shapes) on every
control channel, then one broadcast per dtype of a flat buffer holding the bucket's tensors
of that dtype back to back (:func:`pack_bucket` / :func:`unpack_bucket`): a bucket of
hundreds of small tensors costs a few collectives, not hundreds.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Sequence

import torch

from grpo_mega.rollout.types import EngineConfig, SamplingConfig

__all__ = ["AUTHKEY_ENV", "send", "recv", "sampling_to_json", "sampling_from_json",
           "engine_to_json", "engine_from_json", "store", "weights_group", "pack_bucket", "unpack_bucket",
           "broadcast", "DTYPES"]

AUTHKEY_ENV = "GRPO_MEGA_REMOTE_AUTHKEY"
"""Environment variable holding the control channel's key (hex): the controller makes one
per job and gives it to the servers it spawns; a launcher elsewhere must pass the same."""

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.int8, torch.uint8, torch.bool)}
"""Wire names of the tensor dtypes a bucket may hold."""


def send(conn, msg: dict) -> None:
    """One JSON message (NaN and inf survive: Python's json writes and reads them)."""
    conn.send_bytes(json.dumps(msg).encode())


def recv(conn) -> dict:
    """One JSON message; EOFError when the peer closed the connection (or died)."""
    msg = json.loads(conn.recv_bytes().decode())
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"control message without an 'op': {str(msg)[:200]}")
    return msg


def sampling_to_json(s: SamplingConfig) -> dict:
    return dataclasses.asdict(s)


def sampling_from_json(d: dict) -> SamplingConfig:
    return SamplingConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def engine_to_json(e: EngineConfig) -> dict:
    d = dataclasses.asdict(e)
    d["extra"] = dict(e.extra)
    return d


def engine_from_json(d: dict) -> EngineConfig:
    return EngineConfig(**d)


def store(host: str, port: int, size: int, timeout_s: float, *, is_master: bool = False):
    """The weights group's ``TCPStore``: the controller's is the master (``port`` 0: any free
    one, read back as ``.port``); the servers connect to it."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size=size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def weights_group(store, bind: str | None, rank: int, size: int, backend: str, timeout_s: float):
    """The weights process group over ``store`` (``backend``: ``gloo`` or ``nccl``); returns
    once all ``size`` ranks have joined, or raises after ``timeout_s``. gloo binds to the
    address ``bind`` (loopback keeps a one-node job on loopback; None: the address of this
    host's name); NCCL picks its own transport."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("weights", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind) if bind
                         else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefixed, rank, size, opts)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("rollout.placement=separate on GPU needs torch with NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    raise ValueError(f"weights backend {backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def broadcast(pg, tensor: torch.Tensor, root: int = 0) -> None:
    """In-place broadcast of ``tensor`` from ``root`` over the backend object ``pg``; raises
    (after the group's timeout) when a peer never joins."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


def bucket_header(named: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """``[[name, dtype, shape], ...]`` in the bucket's order (the JSON part of a bucket)."""
    return [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in named]


def _dtype_order(header: Sequence[Sequence[Any]]) -> list[str]:
    """The bucket's dtypes in first-seen order: one flat buffer (one broadcast) each."""
    return list(dict.fromkeys(d for _, d, _ in header))


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], device: torch.device
                ) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """(header, flat buffers): each buffer is 1-D, on ``device``, and holds the bucket's
    tensors of one dtype back to back in bucket order. The copy decouples the broadcast from
    the caller's tensors (the bridge may hand views it reuses)."""
    header = bucket_header(named)
    flats = []
    for dtype in _dtype_order(header):
        parts = [t.detach().reshape(-1) for (_, d, _), (_, t) in zip(header, named) if d == dtype]
        flats.append(torch.cat([p.to(device) for p in parts]) if parts else torch.empty(0))
    return header, flats


def empty_buffers(header: Sequence[Sequence[Any]], device: torch.device) -> list[torch.Tensor]:
    """The receive side's flat buffers for ``header`` (same order and sizes as pack_bucket's)."""
    sizes: dict[str, int] = {}
    for _, d, shape in header:
        if d not in DTYPES:
            raise ValueError(f"bucket tensor dtype {d!r} is not one of {sorted(DTYPES)}")
        sizes[d] = sizes.get(d, 0) + int(torch.Size(shape).numel())
    return [torch.empty(sizes[d], dtype=DTYPES[d], device=device) for d in _dtype_order(header)]


def unpack_bucket(header: Sequence[Sequence[Any]], flats: Sequence[torch.Tensor]
                  ) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor view into its flat buffer)] in header order."""
    index = {d: i for i, d in enumerate(_dtype_order(header))}
    offsets = [0] * len(flats)
    out = []
    for name, d, shape in header:
        i = index[d]
        n = int(torch.Size(shape).numel())
        out.append((name, flats[i][offsets[i]:offsets[i] + n].view(shape)))
        offsets[i] += n
    return out
