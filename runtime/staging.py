"""Moving cache misses from host tables to the device: threaded gathers, pinned buffers, a copy stream.

A miss is gathered on the host into a staging buffer (pinned when the device is a GPU, so the
copy can be asynchronous), then copied on a dedicated CUDA stream; an event recorded after the
copy lets the compute stream wait for exactly that copy and nothing else. Each table owns two
staging buffers used in turn (double buffering): the host fills one while the other's copy is in
flight, and a buffer is refilled only after the event of its previous copy has completed.

On the CPU the same code runs without pinning, streams or copies: the staged rows are used in
place, which is safe because a buffer is refilled only two batches later, after its batch has
been consumed.

Layering: imports nothing of fastopt but the copy stream (:mod:`fastopt.runtime.streams`) and the host's
memory size (:mod:`fastopt.runtime.validate`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from fastopt.runtime.streams import copy_stream
from fastopt.runtime.validate import host_memory_bytes

__all__ = ["HostGatherer", "StagingBuffers", "TransferStream", "available_ram", "pack_tensors", "pin_if_room",
           "pinned_copy", "unpack_tensors"]

# Below this many rows per thread, handing work to the pool costs more than it saves.
_MIN_ROWS_PER_THREAD = 2048
# Rows a thread copies at a time when a mapped table is read into RAM (pinned_copy).
_COPY_ROWS = 1 << 16


class HostGatherer:
    """Gathers rows of a host table into a staging buffer with several threads.

    ``torch.index_select`` releases the GIL while it copies, so the threads of the pool copy
    disjoint slices of the output concurrently. A table of another dtype than ``out`` (a mapped
    float32 table served in bfloat16) is converted slice by slice, so no converted copy of the
    whole table is ever made.

    Args:
        threads: worker threads; 1 gathers on the calling thread.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, int(threads))
        self._pool: Optional[ThreadPoolExecutor] = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="fastopt-gather")
            if self.threads > 1 else None)

    def gather(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> float:
        """Write ``table[ids]`` into ``out`` (same length as ``ids``, converted to its dtype);
        returns the seconds spent."""
        start = time.perf_counter()
        n = ids.numel()
        parts = min(self.threads, n // _MIN_ROWS_PER_THREAD)
        copy = _gather_into if table.dtype == out.dtype else _gather_converted
        if self._pool is None or parts < 2:
            copy(table, ids, out)
        else:
            bounds = [n * i // parts for i in range(parts + 1)]
            futures = [self._pool.submit(copy, table, ids[a:b], out[a:b])
                       for a, b in zip(bounds[:-1], bounds[1:])]
            for future in futures:
                future.result()
        return time.perf_counter() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _gather_into(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(table, 0, ids, out=out)


def _gather_converted(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """``table[ids]`` into ``out`` of another dtype: the rows in the table's dtype, then cast."""
    out.copy_(torch.index_select(table, 0, ids))


class StagingBuffers:
    """Two reusable host buffers for one table's misses, pinned when copies go to a GPU.

    Args:
        row_shape: shape of one row.
        dtype: dtype of the rows on the wire.
        pinned: allocate page-locked memory (needed for asynchronous host-to-device copies).
        count: buffers used in turn.
    """

    def __init__(self, row_shape: Sequence[int], dtype: torch.dtype, pinned: bool,
                 count: int = 2) -> None:
        self.row_shape, self.dtype, self.pinned = tuple(row_shape), dtype, pinned
        self._buffers: List[torch.Tensor] = [self._alloc(0) for _ in range(count)]
        self._events: List[Optional[torch.cuda.Event]] = [None] * count
        self._turn = 0

    def _alloc(self, rows: int) -> torch.Tensor:
        buf = torch.empty((rows,) + self.row_shape, dtype=self.dtype)
        return buf.pin_memory() if self.pinned and rows > 0 else buf

    def acquire(self, rows: int) -> Tuple[int, torch.Tensor]:
        """The next buffer, grown to at least ``rows`` rows, once its previous copy has finished."""
        i = self._turn
        self._turn = (i + 1) % len(self._buffers)
        if self._events[i] is not None:
            self._events[i].synchronize()
            self._events[i] = None
        if self._buffers[i].shape[0] < rows:
            # Grow geometrically so a slowly rising miss count does not re-pin every batch.
            self._buffers[i] = self._alloc(max(rows, 2 * self._buffers[i].shape[0]))
        return i, self._buffers[i][:rows]

    def release_after(self, i: int, event: Optional[torch.cuda.Event]) -> None:
        """Buffer ``i`` may be refilled once ``event`` (its copy) has completed."""
        self._events[i] = event


class TransferStream:
    """Host-to-device copies on a dedicated CUDA stream, each followed by an event.

    Args:
        device: the cache's device; on the CPU, uploads return their input and record no event.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream = copy_stream(device) if self.is_cuda else None

    def upload(self, host: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], Optional[torch.cuda.Event]]:
        """Start copying ``host`` tensors (pinned) to the device; returns them and the copy's event."""
        if not self.is_cuda:
            return list(host), None
        with torch.cuda.stream(self.stream):
            out = [t.to(self.device, non_blocking=True) for t in host]
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def consume(self, tensors: Sequence[torch.Tensor], event: Optional[torch.cuda.Event]) -> None:
        """Make the current stream wait for ``event`` before it uses ``tensors``."""
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            # Allocated on the copy stream, used on this one: keep the memory until this use ends.
            t.record_stream(current)


# bytes each packed tensor starts at a multiple of (a CUDA allocation's alignment is larger)
PACK_ALIGN = 16


def pack_tensors(tensors: Sequence[torch.Tensor], pinned: bool) -> Tuple[torch.Tensor, List[tuple]]:
    """Host tensors of any dtypes in one byte buffer (pinned for an asynchronous upload): one
    copy moves them all, one allocation holds them on the device, one stream record keeps it.

    The tensors of one dtype lie side by side in a run, so that :func:`unpack_tensors` views the
    run in its dtype at once, each starting at a multiple of :data:`PACK_ALIGN` bytes: a kernel
    that reads one sees the alignment a fresh allocation has (a generated kernel specializes on
    16-byte alignment; a step's graph is captured on fresh copies of its inputs).
    Returns the buffer and the layout (per run: its byte range, dtype and tensors)."""
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].element_size(), str(tensors[i].dtype)))
    layout: List[tuple] = []
    start = 0
    for i in order:
        t = tensors[i]
        if not layout or layout[-1][2] != t.dtype:
            layout.append([start, start, t.dtype, []])
        size = t.element_size()
        room = -(-t.numel() * size // PACK_ALIGN) * PACK_ALIGN // size  # elements up to the next tensor
        layout[-1][3].append((i, t.numel(), tuple(t.shape), room))
        start += room * size
        layout[-1][1] = start
    packed = torch.empty(start, dtype=torch.uint8, pin_memory=pinned)
    out = packed.numpy()
    for begin, _, dtype, members in layout:
        for i, n, _, room in members:  # NumPy's copy, not torch's: no dispatch or intra-op threads here
            out[begin:begin + n * dtype.itemsize] = np.ascontiguousarray(tensors[i].numpy()).reshape(-1).view(np.uint8)
            begin += room * dtype.itemsize
    return packed, layout


def unpack_tensors(packed: torch.Tensor, layout: Sequence[tuple]) -> List[torch.Tensor]:
    """:func:`pack_tensors`'s tensors, in the order given there, as views of ``packed`` (on any
    device): one view and one split per dtype, one view per tensor."""
    out: List[Optional[torch.Tensor]] = [None] * sum(len(run[3]) for run in layout)
    for begin, end, dtype, members in layout:
        pieces = torch.split(packed[begin:end].view(dtype), [room for _, _, _, room in members])
        for (i, n, shape, room), piece in zip(members, pieces):
            out[i] = (piece if n == room else piece[:n]).view(shape)
    return out


def available_ram() -> int:
    """Bytes of host memory available to a new allocation (``MemAvailable``: free memory plus
    the page cache the kernel can reclaim); the physical memory where that is not reported."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_memory_bytes()


def pinned_copy(table: np.ndarray, threads: int = 8) -> torch.Tensor:
    """``table`` (a memory-mapped file, say) read into page-locked host memory of exactly its
    size: a GPU then reads its rows itself (zero-copy). The memory is an anonymous mapping of
    its own (page-aligned: no page shared with another registered table), the rows are copied
    into it by ``threads`` threads, then it is registered with the CUDA driver
    (``cudaHostRegister``; torch's pinned allocator would round a large table up to a power of
    two) and unregistered when the returned tensor's memory is freed.

    Raises:
        MemoryError: the RAM or the driver refused the memory or its registration (the CUDA
            runtime's last error is cleared, so later launches do not report it).
    """
    nbytes = int(np.prod(table.shape, dtype=np.int64)) * table.dtype.itemsize
    if nbytes == 0:
        return torch.from_numpy(np.empty(table.shape, dtype=table.dtype))
    try:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise MemoryError(f"no {nbytes:,} bytes of RAM for a pinned copy of the table ({exc}); set "
                          f"cache.pin_ram_fraction to 0 to read it from its file without trying") from None
    out = np.frombuffer(buffer, dtype=table.dtype).reshape(table.shape)
    release = _page_release(table)

    def copy(lo: int) -> None:
        out[lo:lo + _COPY_ROWS] = table[lo:lo + _COPY_ROWS]
        if release is not None:
            release(lo, min(lo + _COPY_ROWS, table.shape[0]))

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="fastopt-pin") as pool:
        list(pool.map(copy, range(0, table.shape[0], _COPY_ROWS)))
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(out.ctypes.data, nbytes, 1))  # cudaHostRegisterPortable
    if err != 0:
        _clear_last_cuda_error()
        raise MemoryError(f"the CUDA driver would not pin a {nbytes:,}-byte table ({_cuda_error_name(cudart, err)}); "
                          f"set cache.pin_ram_fraction to 0 to read it from its file without trying")
    weakref.finalize(out, _unpin, cudart, out.ctypes.data)
    return torch.from_numpy(out)


def pin_if_room(table: np.ndarray, fraction: float) -> Tuple[Optional[torch.Tensor], str]:
    """``table`` read into pinned RAM (:func:`pinned_copy`) when it takes at most ``fraction`` of
    the available memory: ``(the copy, "")``, else ``(None, why not)``, with a RuntimeWarning
    when the RAM or the driver refused."""
    available = available_ram()
    if table.nbytes > fraction * available:
        return None, f"it takes more than cache.pin_ram_fraction ({fraction}) of the {available:,} bytes of RAM available"
    try:
        return pinned_copy(table, threads=max(1, min(8, os.cpu_count() or 1))), ""
    except MemoryError as exc:
        warnings.warn(f"the {table.nbytes:,}-byte mapped table stays on disk, its rows read from the file: {exc}",
                      RuntimeWarning, stacklevel=3)
        return None, str(exc)


def _unpin(cudart, ptr: int) -> None:
    """Unregister a pinned copy once no kernel can still read it (a zero-copy read of a batch
    staged ahead may be in flight when its loader is dropped)."""
    try:
        torch.cuda.synchronize()
    except Exception:  # the CUDA context is gone (interpreter exit): nothing runs any more
        pass
    cudart.cudaHostUnregister(ptr)


def _page_release(table: np.ndarray) -> Optional[Callable[[int, int], None]]:
    """For a read-only mapping of a file (``np.load(mmap_mode="r")``): a function that drops the
    pages of rows ``[lo, hi)`` from the process once copied (``MADV_DONTNEED``: they stay in
    the page cache, and a later read maps them again), so that copying the whole file does not
    count it twice in the resident set. None for any other table."""
    mm = getattr(table, "_mmap", None)
    if mm is None or getattr(table, "mode", None) != "r" or not table.flags.c_contiguous \
            or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    start = table.ctypes.data - np.frombuffer(mm, dtype=np.uint8).ctypes.data
    row, page = table.strides[0], mmap.PAGESIZE

    def release(lo: int, hi: int) -> None:
        first, end = start + lo * row, start + hi * row
        first -= first % page  # whole pages: a neighbor's rows read again from the page cache
        end = min(end + (-end) % page, len(mm))
        try:
            mm.madvise(mmap.MADV_DONTNEED, first, end - first)
        except (OSError, ValueError):
            pass  # only the resident set is at stake

    return release


def _cuda_error_name(cudart, err: int) -> str:
    try:
        return f"CUDA error {err}: {cudart.cudaGetErrorString(cudart.cudaError(err))}"
    except (TypeError, ValueError, AttributeError):  # a code the bindings' enum does not list
        return f"CUDA error {err}"


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error (torch's bindings do not expose cudaGetLastError):
    a failed call sets it, and torch's next launch check would report it as its own."""
    try:
        with open("/proc/self/maps") as f:
            libraries = {line.split()[-1] for line in f if "libcudart" in line.split()[-1]}
    except OSError:
        return
    for path in sorted(libraries):
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except OSError:
            continue
