"""Write a safetensors file from (name, tensor) pairs, streaming.

Shared by the checkpoint converter (HF shards) and the rollout engine's file
transport (weight buckets in /dev/shm for an engine core in a child process).
Unlike ``safetensors.torch.save_file`` it takes tensors that share storage
(q/k/v views of one fused tensor, a tied head) without first cloning them
into a dict. Imports only torch, so any part of the package may use it.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Optional, Sequence

import torch

__all__ = ["write_safetensors"]

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
              torch.uint8: "U8"}


def write_safetensors(path: str, pairs: Sequence[tuple[str, torch.Tensor]],
                      metadata: Optional[dict] = None) -> int:
    """Write ``pairs`` as one safetensors file without first copying them into a dict
    (views that share storage are fine, unlike ``safetensors.torch.save_file``).
    Returns the bytes written. Layout: u64 header length, JSON header, raw data."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in pairs:
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
    return offset
