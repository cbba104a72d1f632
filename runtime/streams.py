"""The process's side streams per device: the copy stream, which no CUDA graph capture can
share, and the stream the warm-up calls before a capture run on.

torch hands side streams out of a pool of 32 per device and priority, round robin: the 33rd
``torch.cuda.Stream()`` of a process is the first one again. A copy stream drawn from that pool
can thus be the stream a CUDA graph is being captured on (``torch.cuda.graph`` draws its capture
stream from the same pool); a staging thread's copies issued there then join the capture, and the
event recorded after them belongs to the graph: waiting on it outside fails with "invalid
argument". The copy stream is drawn once per device, from the high-priority pool, which nothing
else in fastopt draws from; the loader and SlimCache's staging share it.

The warm-up stream is drawn once per device too: cuBLAS keeps a workspace (32 MiB on Hopper, two
with cuBLASLt's) for every stream a matrix product ever ran on, in the device allocator and for the
life of the process, so a fresh stream per capture left 64 MiB allocated per capture, up to the
pool's 32 streams (2 GiB), and a tuning study's later trials measured their predecessors' workspaces.

Layering: imports nothing of fastopt.
"""

from __future__ import annotations

import threading
from typing import Dict

import torch

__all__ = ["copy_stream", "warmup_stream"]

_STREAMS: Dict[int, "torch.cuda.Stream"] = {}
_WARMUP: Dict[int, "torch.cuda.Stream"] = {}
_LOCK = threading.Lock()


def _drawn(streams: Dict[int, "torch.cuda.Stream"], device: torch.device, priority: int) -> "torch.cuda.Stream":
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(index, priority=priority)
        return stream


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream host-to-device copies of ``device`` (a CUDA device) are issued on."""
    return _drawn(_STREAMS, device, -1)


def warmup_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream the warm-up calls before a CUDA graph capture on ``device`` run on (one per
    device: see the module's note on cuBLAS workspaces)."""
    return _drawn(_WARMUP, device, 0)
