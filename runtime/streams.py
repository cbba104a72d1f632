"""The process's copy stream per device, which no CUDA graph capture can share.

torch hands side streams out of a pool of 32 per device and priority, round robin: the 33rd
``torch.cuda.Stream()`` of a process is the first one again. A copy stream drawn from that pool
can thus be the stream a CUDA graph is being captured on (``torch.cuda.graph`` draws its capture
stream from the same pool); a staging thread's copies issued there then join the capture, and the
event recorded after them belongs to the graph: waiting on it outside fails with "invalid
argument". The copy stream is drawn once per device, from the high-priority pool, which nothing
else in fastopt draws from; the loader and SlimCache's staging share it.

Layering: imports nothing of fastopt.
"""

from __future__ import annotations

import threading
from typing import Dict

import torch

__all__ = ["copy_stream"]

_STREAMS: Dict[int, "torch.cuda.Stream"] = {}
_LOCK = threading.Lock()


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream host-to-device copies of ``device`` (a CUDA device) are issued on."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = _STREAMS[index] = torch.cuda.Stream(index, priority=-1)
        return stream
