"""Read event streams from the formats TGNN work uses, chosen by content, not extension.

Formats (optionally gzip-compressed, detected by magic bytes):

* JODIE / TGL CSV: header ``u,i,ts,label[,features...]``; bipartite, users and items are
  numbered separately and items are placed after users.
* TGL ``edges.csv``: header ``[idx],src,dst,time[,ext_roll]``.
* DGB CSV: header ``source,destination,timestamp,state_label,w``; ``w`` becomes a 1-d edge
  feature.
* Whitespace ``src dst ts`` (SNAP) or ``t i j`` (SocioPatterns), no header: the time column is
  the one whose values never decrease.
* ``.npz`` written by :func:`save_npz` (and by ``fastopt data synth``).
* A folder of ``.npy`` files with a ``graph.json`` (:mod:`fastopt.data.npydir`, written by
  ``fastopt data synth --out DIR``): memory-mapped, not parsed, not cached.

Ids are remapped to dense ``0..N-1`` and events sorted stably by time. Parsed files are cached
as ``.npz`` in the user cache directory (:func:`dataset_cache_dir`; nothing is written beside
the data or into the package), keyed by the content hash of the file. Every ``.npz`` fastopt writes carries the SHA-256 of its arrays
(a cache entry also the hash of the file it was parsed from); one that no longer matches is
refused, and a damaged cache entry is reported (a ``RuntimeWarning``) and parsed again.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import warnings
import zipfile
from importlib import resources
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fastopt.codegen.cache import atomic_file
from fastopt.config import default_config
from fastopt.data.graph import TemporalGraph
from fastopt.data.npydir import MANIFEST, is_npy_dir, load_npy_dir
from fastopt.errors import DataError

__all__ = ["load_dataset", "load_file", "save_npz", "builtin_datasets", "resolve_dataset", "dataset_cache_dir"]

# Version of the parser and of the cache entries' layout (2: entries carry content hashes).
_PARSER_VERSION = "2"
# Keys of the hashes inside an .npz: of its other arrays, and of the file a cache entry was parsed from.
_CHECKSUM = "content_sha256"
_SOURCE = "source_sha256"
# float64 keeps integers exact below 2**53: larger ids in a text file could merge distinct nodes.
_MAX_TEXT_ID = 2 ** 53

_SRC = {"u", "src", "source", "user", "user_id", "src_id"}
_DST = {"i", "dst", "destination", "item", "item_id", "dst_id"}
_TIME = {"ts", "t", "time", "timestamp"}
_LABEL = {"label", "state_label", "y"}
_SKIP = {"", "idx", "index", "ext_roll", "unnamed: 0"}
_JODIE_SRC = {"u", "user", "user_id"}


def builtin_datasets() -> dict:
    """Names of datasets shipped inside the package, mapped to their files."""
    root = resources.files("fastopt") / "datasets"
    return {p.name.split(".")[0]: Path(str(p)) for p in root.iterdir() if p.name.endswith(".gz")}


def resolve_dataset(name_or_path: Union[str, os.PathLike]) -> Path:
    """A built-in dataset name (``"wikipedia"``) resolves to its shipped file; anything else is a path."""
    builtins = builtin_datasets()
    key = str(name_or_path)
    if key in builtins:
        return builtins[key]
    path = Path(key).expanduser()
    if not path.exists():
        raise DataError(
            f"dataset {key!r} is neither a built-in dataset ({', '.join(sorted(builtins))}) nor an "
            f"existing file; pass one of those names or a path to an event file"
        )
    if path.is_dir():
        if is_npy_dir(path):
            return path
        for candidate in ("edges.csv", "edges.csv.gz"):
            if (path / candidate).exists():
                return path / candidate
        raise DataError(f"{path} is a directory without edges.csv or {MANIFEST}; pass the event file "
                        f"itself or a folder written by `fastopt data synth`")
    return path


def load_dataset(name_or_path: Union[str, os.PathLike], *, edge_dim: int = 0, node_dim: int = 0,
                 seed: int = 0, cache: bool = True) -> TemporalGraph:
    """Load a built-in dataset or a file and attach random features where asked and missing.

    Args:
        name_or_path: ``"wikipedia"`` (shipped with fastopt) or a path in any supported format.
        edge_dim: width of deterministic random edge features when the data carries none.
        node_dim: width of deterministic random node features when the data carries none.
        seed: seed of those random features.
        cache: read and write the parsed ``.npz`` cache.
    """
    graph = load_file(resolve_dataset(name_or_path), cache=cache)
    if edge_dim or node_dim:
        graph = graph.with_random_features(edge_dim=edge_dim, node_dim=node_dim, seed=seed)
    return graph


def load_file(path: Union[str, os.PathLike], cache: bool = True) -> TemporalGraph:
    """Parse one event file (format detected from its content), or map a graph folder."""
    path = Path(path)
    if is_npy_dir(path):
        return load_npy_dir(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DataError(f"{path} looks gzip-compressed but cannot be decompressed ({exc})") from None
    name = path.name.split(".")[0]
    if raw[:6] == b"\x93NUMPY" or raw[:2] == b"PK":
        return _load_npz(path, name)
    source = hashlib.sha256(raw).hexdigest()
    digest = source[:16]
    cached = dataset_cache_dir() / f"{path.name}.{digest}.v{_PARSER_VERSION}.npz"
    if cache and cached.exists():
        try:
            return _load_npz(cached, name, source=source)
        except DataError as exc:
            warnings.warn(f"dataset cache entry {cached} is not used ({exc}); {path} is "
                          f"parsed again and the entry rewritten", RuntimeWarning, stacklevel=2)
    graph = _parse_text(raw, name, str(path))
    if cache:
        _write_cache(cached, _arrays(graph, **{_SOURCE: np.str_(source)}))
    return graph


def save_npz(graph: TemporalGraph, path: Union[str, os.PathLike]) -> None:
    """Write a graph to ``.npz`` atomically (temp file, then rename), with its content hash."""
    _write_npz(_arrays(graph), path)


def _arrays(graph: TemporalGraph, **extra) -> dict:
    """The arrays of ``graph`` as :func:`save_npz` writes them, ``extra`` and their content hash."""
    arrays = dict(src=graph.src, dst=graph.dst, ts=graph.ts, num_nodes=np.int64(graph.num_nodes),
                  bipartite=np.bool_(graph.bipartite), parser_version=np.str_(_PARSER_VERSION))
    for key in ("node_feat", "edge_feat", "labels"):
        if getattr(graph, key) is not None:
            arrays[key] = getattr(graph, key)
    arrays.update(extra)
    arrays[_CHECKSUM] = np.str_(_checksum(arrays))
    return arrays


def _checksum(arrays: dict) -> str:
    """SHA-256 over every array but the checksum itself: names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for key in sorted(k for k in arrays if k != _CHECKSUM):
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.data)
    return h.hexdigest()


def _write_npz(arrays: dict, path: Union[str, os.PathLike]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, mode=0o666) as f:  # readable by others, as a shared dataset must be
        np.savez(f, **arrays)


# --------------------------------------------------------------------------------- cache
def dataset_cache_dir() -> Path:
    """Where parsed event files are cached: ``config.data.cache_dir``, else
    ``$XDG_CACHE_HOME/fastopt/datasets`` or ``~/.cache/fastopt/datasets``."""
    configured = default_config().data.cache_dir
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastopt" / "datasets"


def _write_cache(target: Path, arrays: dict) -> None:
    try:
        _write_npz(arrays, target)
    except OSError as exc:
        warnings.warn(f"the dataset cache {target.parent} cannot be written ({exc.strerror or exc}); "
                      f"the file will be parsed again next time. Set data.cache_dir "
                      f"(FASTOPT_DATA_CACHE_DIR) to a writable folder", RuntimeWarning, stacklevel=3)


def _load_npz(path: Path, name: str, source: Optional[str] = None) -> TemporalGraph:
    """A graph from an ``.npz``, its content hash checked when it has one; ``source`` (the
    SHA-256 of the file a cache entry was parsed from) makes the hashes mandatory."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {key: z[key] for key in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} is not a readable .npz file ({exc}); write it with "
                        f"fastopt.data.save_npz") from None
    _check_hashes(path, arrays, source)
    missing = {"src", "dst", "ts"} - set(arrays)
    if missing:
        raise DataError(f"{path} is an .npz without {sorted(missing)}; write it with "
                        f"fastopt.data.save_npz")
    try:
        src, dst = arrays["src"], arrays["dst"]
        num_nodes = int(arrays["num_nodes"]) if "num_nodes" in arrays else int(max(src.max(), dst.max()) + 1)
        return TemporalGraph(
            src, dst, arrays["ts"], num_nodes,
            node_feat=arrays.get("node_feat"), edge_feat=arrays.get("edge_feat"),
            labels=arrays.get("labels"), name=name,
            bipartite=bool(arrays["bipartite"]) if "bipartite" in arrays else False,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, DataError):
            raise DataError(f"{path}: {exc}") from None
        raise DataError(f"{path} holds arrays that do not form a graph ({exc}); write it with "
                        f"fastopt.data.save_npz") from None


def _check_hashes(path: Path, arrays: dict, source: Optional[str]) -> None:
    if _CHECKSUM not in arrays:
        if source is not None:
            raise DataError(f"{path} carries no content hash; a cache entry must")
        return
    found, stored = _checksum(arrays), str(arrays[_CHECKSUM])
    if found != stored:
        raise DataError(f"{path} does not match its content hash (arrays hash to {found[:16]}..., "
                        f"the file records {stored[:16]}...): it was altered or damaged. Write it "
                        f"again with fastopt.data.save_npz")
    if source is not None and str(arrays.get(_SOURCE, "")) != source:
        raise DataError(f"{path} was parsed from another file (source hash "
                        f"{str(arrays.get(_SOURCE, 'none'))[:16]}..., expected {source[:16]}...)")


# --------------------------------------------------------------------------------- text
def _parse_text(raw: bytes, name: str, where: str) -> TemporalGraph:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{where} is not a text event file (not UTF-8); give a CSV, a whitespace "
                        f"edge list or an .npz") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise DataError(f"{where} is empty; give a file with at least one event")
    first = lines[0]
    delim = "," if "," in first else None
    header = None
    if not _is_numeric_row(first, delim):
        header = [h.strip().lower() for h in (first.split(delim) if delim else first.split())]
        lines = lines[1:]
    if not lines:
        raise DataError(f"{where} has a header but no events; give a file with at least one event")
    table = _numeric_table(lines, delim, where, line_offset=2 if header else 1)
    if header is not None:
        return _from_header(table, header, name, where)
    return _from_headerless(table, name, where)


def _is_numeric_row(line: str, delim: Optional[str]) -> bool:
    tokens = [t for t in (line.split(delim) if delim else line.split()) if t.strip()]
    try:
        [float(t) for t in tokens]
    except ValueError:
        return False
    return bool(tokens)


def _numeric_table(lines: list, delim: Optional[str], where: str, line_offset: int) -> np.ndarray:
    ncols = len(lines[0].split(delim)) if delim else len(lines[0].split())
    body = "\n".join(lines)
    if delim:
        body = body.replace(delim, " ")
    try:
        flat = np.array(body.split(), dtype=np.float64)
    except ValueError:
        for i, line in enumerate(lines):
            if not _is_numeric_row(line, delim):
                raise DataError(
                    f"{where}, line {i + line_offset}: {line[:80]!r} is not numeric; every event "
                    f"row must hold numbers only (ids, time, label, features)"
                ) from None
        raise
    if flat.size != ncols * len(lines):
        for i, line in enumerate(lines):
            n = len(line.replace(delim, " ").split()) if delim else len(line.split())
            if n != ncols:
                raise DataError(f"{where}, line {i + line_offset} has {n} values, the first row "
                                f"has {ncols} columns; every row needs a value in every column")
    return flat.reshape(-1, ncols)


def _ids(col: np.ndarray, what: str, where: str) -> np.ndarray:
    if not np.isfinite(col).all() or (col != np.floor(col)).any():
        bad = col[~np.isfinite(col) | (col != np.floor(col))][0]
        raise DataError(f"{where}: {what} id {bad!r} is not an integer; node ids must be integers")
    if col.size and np.abs(col).max() >= _MAX_TEXT_ID:
        bad = col[np.abs(col) >= _MAX_TEXT_ID][0]
        raise DataError(f"{where}: {what} id {bad:.0f} is at or beyond 2**53 in magnitude, where text ids "
                        f"stop being exact (distinct nodes could merge); renumber the ids below 2**53 "
                        f"or pass the events as an .npz of int64 arrays")
    return col.astype(np.int64)


def _times(col: np.ndarray, where: str) -> np.ndarray:
    bad = ~np.isfinite(col)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"{where}: event {i} has timestamp {col[i]}; timestamps must be finite "
                        f"(no NaN or infinity). Drop or repair that event")
    return col


def _from_header(table: np.ndarray, header: list, name: str, where: str) -> TemporalGraph:
    ncols = table.shape[1]
    if len(header) > ncols:
        raise DataError(f"{where}: header has {len(header)} columns but rows have {ncols}")
    role = {}
    for j, h in enumerate(header):
        for key, names in (("src", _SRC), ("dst", _DST), ("ts", _TIME), ("label", _LABEL)):
            if h in names and key not in role:
                role[key] = j
                break
    missing = [k for k in ("src", "dst", "ts") if k not in role]
    if missing:
        raise DataError(
            f"{where}: header {header} names no {'/'.join(missing)} column; expected JODIE "
            f"(u,i,ts,label), TGL (src,dst,time) or DGB (source,destination,timestamp) columns"
        )
    used = set(role.values()) | {j for j, h in enumerate(header) if h in _SKIP}
    feat_cols = [j for j in range(ncols) if j not in used]
    bipartite = header[role["src"]] in _JODIE_SRC
    return _build(table[:, role["src"]], table[:, role["dst"]], table[:, role["ts"]],
                  table[:, feat_cols] if feat_cols else None,
                  table[:, role["label"]] if "label" in role else None, name, where, bipartite)


def _from_headerless(table: np.ndarray, name: str, where: str) -> TemporalGraph:
    ncols = table.shape[1]
    if ncols < 3:
        raise DataError(f"{where}: rows have {ncols} columns; an event needs at least src, dst and "
                        f"time")
    time_col = 2
    if not _non_decreasing(table[:, 2]) and _non_decreasing(table[:, 0]):
        time_col = 0  # SocioPatterns' `t i j`
    id_cols = [c for c in range(3) if c != time_col]
    extra = [c for c in range(3, ncols)]
    return _build(table[:, id_cols[0]], table[:, id_cols[1]], table[:, time_col],
                  table[:, extra] if extra else None, None, name, where, bipartite=False)


def _non_decreasing(col: np.ndarray) -> bool:
    col = col[np.isfinite(col)]  # a bad timestamp is reported later, not taken for an id column
    return bool(col.size < 2 or (np.diff(col) >= 0).all())


def _build(src, dst, ts, feat, labels, name, where, bipartite) -> TemporalGraph:
    src = _ids(src, "source", where)
    dst = _ids(dst, "destination", where)
    ts = _times(ts, where)
    if bipartite:
        users, src = np.unique(src, return_inverse=True)
        items, dst = np.unique(dst, return_inverse=True)
        dst = dst + users.size
        num_nodes = users.size + items.size
    else:
        nodes, inv = np.unique(np.concatenate([src, dst]), return_inverse=True)
        src, dst = inv[: src.size], inv[src.size :]
        num_nodes = nodes.size
    order = np.argsort(ts, kind="stable")
    return TemporalGraph(
        src[order], dst[order], ts[order], int(num_nodes),
        edge_feat=None if feat is None else feat[order].astype(np.float32),
        labels=None if labels is None else labels[order].astype(np.int64),
        name=name, bipartite=bipartite,
    )
