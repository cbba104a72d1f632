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
would cost more than the load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Tuple, Union

import numpy as np

from fastopt.data.graph import TemporalGraph
from fastopt.errors import DataError

__all__ = ["MANIFEST", "is_npy_dir", "load_npy_dir", "write_npy_dir", "npy_dir_bytes"]

MANIFEST = "graph.json"
_FORMAT = 1
# column name -> dtype of its file
_COLUMNS = {"src": np.int64, "dst": np.int64, "ts": np.float64, "edge_feat": np.float32}
# slack kept free on the disk beyond the files themselves (headers, the manifest, other writers)
_DISK_SLACK = 64 << 20

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
            written = 0
            for chunk in chunks:
                for k, part in zip(_COLUMNS, chunk):
                    if k in files:
                        files[k].write(np.ascontiguousarray(part, dtype=columns[k]).data)
                written += len(chunk[0])
        finally:
            for f in files.values():
                f.close()
        if written != num_events:
            raise DataError(f"the chunks held {written:,} events, not the {num_events:,} announced")
        if node_feat is not None:
            np.save(tmp / "node_feat.npy", np.ascontiguousarray(node_feat, dtype=np.float32))
        manifest = {"format": _FORMAT, "name": name, "num_nodes": int(num_nodes),
                    "num_events": int(num_events), "edge_dim": int(edge_dim),
                    "bipartite": bool(bipartite), "made_by": meta or {}}
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
    return TemporalGraph(arrays["src"], arrays["dst"], arrays["ts"], num_nodes, node_feat=node_feat,
                         edge_feat=arrays.get("edge_feat"), name=str(manifest.get("name", path.name)),
                         bipartite=bool(manifest.get("bipartite", False)))
