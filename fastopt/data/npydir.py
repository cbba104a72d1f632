"""A graph as a folder of ``.npy`` files, written a chunk at a time and read memory-mapped.

Layout: ``graph.json`` (format version, node count, event count, edge feature width, name,
bipartite flag and how the graph was made) beside ``src.npy``, ``dst.npy`` (int64), ``ts.npy``
(float64) and, when the graph has them, ``edge_feat.npy`` (float32, one row per event) and
``node_feat.npy`` (float32, one row per node).

Why a folder and not an ``.npz``: an ``.npz`` is a zip archive, which ``np.load`` cannot map, so
every array of it would be read into RAM. A folder of plain ``.npy`` files is read with
``np.load(mmap_mode="r")``: a 50-million-event graph with 186-d features (37 GB of features) opens
in a moment and its rows stay on disk until a batch gathers them. The writer streams each chunk
to the files through ordinary writes, so neither writing nor reading holds all events in RAM.

Unlike an ``.npz`` the folder carries no content hash: hashing tens of gigabytes at every load
would cost more than the load. For the same reason the NaN/infinity scan of the features, which
reads every byte, runs once: the manifest's ``checked`` entry records the size and modification
time (ns) of each feature file as it was when found finite, by the writer (which scans each chunk
as it writes it) or by the first load that scanned it. A load whose files match the record skips
the scan; a file of another size or time is scanned again (and the record renewed when it passes).

A write that lands within the file system's timestamp granularity of the recorded time would
leave the time unchanged, so a record is made only of times that lie in the past by more than
:data:`_SETTLED_NS` when the scan starts: the writer sets its files' times back by that much, and a
load records nothing for a file changed more recently (the next load scans it again).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, Tuple, Union

import numpy as np

from fastopt.codegen.cache import atomic_file
from fastopt.data.graph import TemporalGraph, check_finite
from fastopt.errors import DataError

__all__ = ["MANIFEST", "is_npy_dir", "load_npy_dir", "write_npy_dir", "npy_dir_bytes"]

MANIFEST = "graph.json"
_FORMAT = 1
# column name -> dtype of its file
_COLUMNS = {"src": np.int64, "dst": np.int64, "ts": np.float64, "edge_feat": np.float32}
# slack kept free on the disk beyond the files themselves (headers, the manifest, other writers)
_DISK_SLACK = 64 << 20
# the feature files: those the NaN/infinity scan reads and the `checked` record covers
_FEATURES = ("node_feat", "edge_feat")
# A recorded modification time must be this much older than the scan: file systems stamp times
# with a granularity (1 s on ext3, 2 s on FAT), and a write within it would not change the time.
_SETTLED_NS = 2_000_000_000

Chunk = Tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray]]


def is_npy_dir(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a folder written by :func:`write_npy_dir` (it holds ``graph.json``)."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def npy_dir_bytes(num_events: int, edge_dim: int) -> int:
    """Bytes the files of a graph of ``num_events`` events and ``edge_dim``-wide features take."""
    return num_events * (8 + 8 + 8 + 4 * edge_dim)


def write_npy_dir(out: Union[str, os.PathLike], chunks: Iterable[Chunk], *, num_events: int,
                  num_nodes: int, edge_dim: int, name: str, bipartite: bool = False,
                  node_feat: Optional[np.ndarray] = None, meta: Optional[dict] = None) -> Path:
    """Write the events of ``chunks`` (consecutive ``(src, dst, ts, edge_feat)`` pieces, in time
    order) to the folder ``out``, holding one chunk in RAM at a time.

    The files go to a hidden folder beside ``out`` that is renamed to ``out`` once complete, so a
    run killed midway leaves no half-written graph under the asked name.

    Args:
        out: the folder to create; it must not exist or be empty.
        chunks: the events, chunk by chunk; ``edge_feat`` is None when ``edge_dim`` is 0.
        num_events: events the chunks hold in all (the ``.npy`` headers are written first).
        num_nodes: node count of the graph.
        edge_dim: width of the edge features (0: no ``edge_feat.npy``).
        name: the graph's name.
        bipartite: whether sources and destinations are disjoint node sets.
        node_feat: node features (``[num_nodes, d]``), written whole: they are per node, not
            per event.
        meta: how the graph was made (generator, parameters, seed), kept in the manifest.
    """
    out = Path(out)
    if num_events < 1:
        raise DataError(f"num_events must be >= 1 (got {num_events}); pass e.g. --events 1000000")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty folder; pass a new folder name or "
                        f"remove {out} first")
    out.parent.mkdir(parents=True, exist_ok=True)
    need = npy_dir_bytes(num_events, edge_dim) + (0 if node_feat is None else 4 * np.size(node_feat))
    free = shutil.disk_usage(out.parent).free
    if need + _DISK_SLACK > free:
        raise DataError(f"{num_events:,} events with {edge_dim}-d features need {need / 2**20:,.0f} MiB "
                        f"(and {_DISK_SLACK >> 20} MiB to spare), but {out.parent} has "
                        f"{free / 2**20:,.0f} MiB free; pass fewer --events, a "
                        f"narrower --edge-dim or an --out on a larger disk")
    columns = {k: dt for k, dt in _COLUMNS.items() if k != "edge_feat" or edge_dim > 0}
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        files = {k: open(tmp / f"{k}.npy", "wb") for k in columns}
        try:
            for k, f in files.items():
                shape = (num_events, edge_dim) if k == "edge_feat" else (num_events,)
                np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(columns[k]).str,
                                                         "fortran_order": False, "shape": shape})
            written, finite = 0, True
            for chunk in chunks:
                for k, part in zip(_COLUMNS, chunk):
                    if k in files:
                        part = np.ascontiguousarray(part, dtype=columns[k])
                        # scanned here, in RAM, so that no load has to read the file to scan it
                        finite = finite and (k != "edge_feat" or bool(np.isfinite(part).all()))
                        files[k].write(part.data)
                written += len(chunk[0])
        finally:
            for f in files.values():
                f.close()
        if written != num_events:
            raise DataError(f"the chunks held {written:,} events, not the {num_events:,} announced")
        if node_feat is not None:
            node_feat = np.ascontiguousarray(node_feat, dtype=np.float32)
            finite = finite and bool(np.isfinite(node_feat).all())
            np.save(tmp / "node_feat.npy", node_feat)
        manifest = {"format": _FORMAT, "name": name, "num_nodes": int(num_nodes),
                    "num_events": int(num_events), "edge_dim": int(edge_dim),
                    "bipartite": bool(bipartite), "made_by": meta or {}}
        if finite:  # features with a NaN are left unrecorded: the first load reports them
            settled = time.time_ns() - _SETTLED_NS
            for file in _feature_files(tmp):
                os.utime(file, ns=(file.stat().st_atime_ns, settled))
            manifest["checked"] = _stamps(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_npy_dir(path: Union[str, os.PathLike]) -> TemporalGraph:
    """The graph in the folder ``path``, its arrays memory-mapped read-only (``np.memmap``)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        num_nodes, num_events = int(manifest["num_nodes"]), int(manifest["num_events"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path / MANIFEST} is not a readable graph manifest ({exc}); write the "
                        f"folder with `fastopt data synth ... --out {path}`") from None
    if manifest.get("format") != _FORMAT:
        raise DataError(f"{path} is a graph folder of format {manifest.get('format')!r}; this "
                        f"fastopt reads format {_FORMAT}. Write it again with this version")
    arrays = {}
    for key, dtype in _COLUMNS.items():
        file = path / f"{key}.npy"
        if key == "edge_feat" and not file.exists():
            continue
        try:
            arrays[key] = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"{file} is not a readable .npy file ({exc}); write the folder again") from None
        if arrays[key].dtype != dtype or arrays[key].shape[:1] != (num_events,):
            raise DataError(f"{file} holds {arrays[key].dtype} of shape {arrays[key].shape}; the "
                            f"manifest asks for {np.dtype(dtype)} with {num_events:,} rows. Write "
                            f"the folder again")
    node_feat = None
    if (path / "node_feat.npy").exists():
        try:
            node_feat = np.load(path / "node_feat.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"{path / 'node_feat.npy'} is not a readable .npy file ({exc}); write "
                            f"the folder again") from None
    _scan_unless_recorded(path, manifest, {"node_feat": node_feat, "edge_feat": arrays.get("edge_feat")})
    return TemporalGraph(arrays["src"], arrays["dst"], arrays["ts"], num_nodes, node_feat=node_feat,
                         edge_feat=arrays.get("edge_feat"), name=str(manifest.get("name", path.name)),
                         bipartite=bool(manifest.get("bipartite", False)), features_checked=True)


def _feature_files(path: Path) -> list:
    return [path / f"{k}.npy" for k in _FEATURES if (path / f"{k}.npy").exists()]


def _stamps(path: Path) -> dict:
    """Size and modification time (ns) of each feature file of the folder ``path``."""
    out = {}
    for file in _feature_files(path):
        st = file.stat()
        out[file.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def _scan_unless_recorded(path: Path, manifest: dict, tables: dict) -> None:
    """Scan the feature tables for NaN and infinity unless the manifest records that these very
    files (same sizes and times) were scanned; after a scan that passes, record it when the files'
    times are settled (see the module's docstring) and the folder is writable."""
    start = time.time_ns()
    stamps = _stamps(path)
    if not stamps or manifest.get("checked") == stamps:
        return
    for name, table in tables.items():
        if table is not None and table.ndim >= 1 and table.size:
            if table.dtype != np.float32:  # scanned as the graph will hold it (1e300 -> inf)
                table = np.asarray(table, dtype=np.float32)
            # a 2-d table as it is: only the mapping itself is read from its file, not a view of it
            check_finite(name, table if table.ndim == 2 else table.reshape(table.shape[0], -1))
    if _stamps(path) != stamps or any(s["mtime_ns"] > start - _SETTLED_NS for s in stamps.values()):
        return  # changed during the scan, or too recently to tell a later change apart
    try:
        with atomic_file(path / MANIFEST) as f:
            f.write((json.dumps({**manifest, "checked": stamps}, indent=1) + "\n").encode())
    except OSError:
        pass  # a read-only folder: the next load scans again
