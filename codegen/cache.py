"""Content-addressed on-disk cache of generated kernel modules.

Triton compiles only functions whose source lives in a real file, so every generated module is
written to the cache directory and imported from there. The file name is derived from a
:class:`CacheKey`, the hash of everything that can change the compiled kernel: the generated
source, the :class:`~fastopt.codegen.kernel_config.KernelConfig`, the GPU name and compute
capability, and the torch, triton and fastopt versions. Files are written atomically (a temporary
file in the same directory, then ``os.replace``), so concurrent processes never import a partial
module; each module has a JSON sidecar with its key, which :meth:`KernelCache.describe` uses to
explain a miss ("the entry for this source differs in: triton_version ...").

An entry on disk is trusted only after its bytes hash to the SHA-256 of the text its key stands
for: a truncated or altered file is rewritten and reported (a ``RuntimeWarning``), never imported,
and the module is executed from the text that was checked, not read again.

Layout: ``<cache_dir>/fo_<family>_<digest16>.py`` (+ ``.json``), the kernel inside named
``fo_<family>_<digest8>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import linecache
import os
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, Dict, Iterator, Optional, Tuple, Union

import torch

from fastopt.codegen.kernel_config import KernelConfig
from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["CacheKey", "KernelCache", "kernel_cache", "device_identity", "default_cache_dir",
           "KERNEL_NAME_PLACEHOLDER", "atomic_file", "package_version"]

# Name of the kernel in a rendered template before the cache names it fo_<family>_<hash8>.
KERNEL_NAME_PLACEHOLDER = "fo_kernel_unnamed"


@functools.lru_cache(maxsize=None)
def package_version(package: str) -> str:
    """An installed package's version, or ``"not installed"``; cached (reading package metadata
    scans ``sys.path``, about half a millisecond a call)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def device_identity(device: torch.device) -> Tuple[str, str]:
    """``(name, compute capability)`` of the device a kernel is compiled for."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_identity(index)
    return f"{device.type} (triton interpreter)", "0.0"


@functools.lru_cache(maxsize=None)
def _cuda_identity(index: int) -> Tuple[str, str]:
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), f"{major}.{minor}"


def default_cache_dir() -> Path:
    """``config.kernels.cache_dir``, else ``$XDG_CACHE_HOME/fastopt/kernels`` or ``~/.cache/...``."""
    configured = default_config().kernels.cache_dir
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastopt" / "kernels"


@dataclass(frozen=True)
class CacheKey:
    """Everything that determines a compiled kernel; :attr:`digest` names its cache entry."""

    family: str
    source_sha256: str
    config: str
    device_name: str
    capability: str
    torch_version: str
    triton_version: str
    fastopt_version: str

    @classmethod
    def build(cls, family: str, source: str, config: KernelConfig, device: torch.device,
              versions: Optional[Dict[str, str]] = None) -> "CacheKey":
        """Key of ``source`` (rendered with :data:`KERNEL_NAME_PLACEHOLDER`) under ``config``."""
        versions = versions or {}
        name, capability = device_identity(device)
        return cls(
            family=family,
            source_sha256=hashlib.sha256(source.encode()).hexdigest(),
            config=json.dumps(config.to_dict(), sort_keys=True),
            device_name=name,
            capability=capability,
            torch_version=versions.get("torch", torch.__version__),
            triton_version=versions.get("triton", package_version("triton")),
            fastopt_version=versions.get("fastopt", package_version("fastopt")),
        )

    @property
    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def kernel_name(self) -> str:
        return f"fo_{self.family}_{self.digest[:8]}"

    @property
    def module_name(self) -> str:
        return f"fo_{self.family}_{self.digest[:16]}"

    def differences(self, other: "CacheKey") -> Dict[str, Tuple[str, str]]:
        """Components that differ, as ``{field: (this, other)}``."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return {f: (mine[f], theirs[f]) for f in mine if mine[f] != theirs[f]}

    def describe(self) -> str:
        """One line per component, for logs and for explaining a miss."""
        lines = [f"kernel {self.kernel_name} (digest {self.digest[:16]})"]
        for field, value in dataclasses.asdict(self).items():
            shown = value[:16] + "..." if field == "source_sha256" else value
            lines.append(f"  {field}: {shown}")
        return "\n".join(lines)


@contextlib.contextmanager
def atomic_file(path: Union[str, os.PathLike], mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through, so that readers see the old file or the whole new
    one: the data goes to a temporary file in the same folder, is flushed to disk, and is renamed
    over ``path`` when the block ends without an error (else the temporary file is removed). A
    process killed mid-write leaves at most a hidden ``.<name>.*.tmp`` beside the old file;
    concurrent writers each rename their own whole file.

    Args:
        path: the file to replace.
        mode: permission bits of the new file, less the umask (``mkstemp`` alone gives 0600).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, mode & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _entry_problem(path: Path, text: str) -> Optional[str]:
    """Why the entry at ``path`` cannot stand for ``text`` (``"missing"``, altered, unreadable), or
    None when its bytes hash to the SHA-256 of ``text``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"cannot be read ({exc})"
    expected = hashlib.sha256(text.encode()).hexdigest()
    found = hashlib.sha256(raw).hexdigest()
    if found != expected:
        return (f"does not match its key: content SHA-256 {found[:16]}... ({len(raw)} bytes), "
                f"expected {expected[:16]}... ({len(text.encode())} bytes); truncated or altered")
    return None


class KernelCache:
    """Generated modules on disk, imported once per process.

    Args:
        root: Cache directory (created on first write).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self._modules: Dict[str, ModuleType] = {}
        self._lock = threading.Lock()
        self.stats = {"memory_hits": 0, "disk_hits": 0, "writes": 0, "rebuilt": 0}

    def paths(self, key: CacheKey) -> Tuple[Path, Path]:
        """The module file and its JSON sidecar for ``key``."""
        return self.root / f"{key.module_name}.py", self.root / f"{key.module_name}.json"

    def load(self, key: CacheKey, source: str):
        """The kernel of ``source`` for ``key``: from memory, from disk, or written then imported.

        Args:
            key: The key built from ``source`` (see :meth:`CacheKey.build`).
            source: Module text naming its kernel :data:`KERNEL_NAME_PLACEHOLDER`.

        Returns:
            The ``@triton.jit`` function ``fo_<family>_<hash8>``.
        """
        with self._lock:
            module = self._modules.get(key.digest)
            if module is not None:
                self.stats["memory_hits"] += 1
                return getattr(module, key.kernel_name)
            path, meta = self.paths(key)
            text = source.replace(KERNEL_NAME_PLACEHOLDER, key.kernel_name)
            problem = _entry_problem(path, text)
            if problem is None:
                self.stats["disk_hits"] += 1
            else:
                if problem != "missing":
                    self.stats["rebuilt"] += 1
                    warnings.warn(f"kernel cache entry {path} {problem}; it was rebuilt from the "
                                  f"generated source, not imported", RuntimeWarning, stacklevel=2)
                self._write(path, meta, key, text)
            module = self._import(path, key, text)
            self._modules[key.digest] = module
            return getattr(module, key.kernel_name)

    def _write(self, path: Path, meta: Path, key: CacheKey, text: str) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as f:
                f.write(text.encode())
            with atomic_file(meta) as f:
                f.write(json.dumps(dataclasses.asdict(key), indent=2, sort_keys=True).encode())
        except OSError as exc:
            raise KernelError(
                f"cannot write kernel {key.kernel_name} to {self.root} ({exc}); set "
                f"FASTOPT_KERNELS_CACHE_DIR to a writable directory"
            ) from exc
        self.stats["writes"] += 1

    @staticmethod
    def _import(path: Path, key: CacheKey, text: str) -> ModuleType:
        """Execute the checked ``text`` as the module of ``path`` (not the file read again, which
        another process may be replacing); Triton reads the kernel's source through linecache,
        which is given the same text."""
        spec = importlib.util.spec_from_file_location(key.module_name, path)
        module = importlib.util.module_from_spec(spec)
        # mtime None: linecache keeps this entry instead of re-reading the file
        linecache.cache[str(path)] = (len(text), None, text.splitlines(True), str(path))
        sys.modules[key.module_name] = module
        exec(compile(text, str(path), "exec"), module.__dict__)
        return module

    def entries(self) -> Dict[str, CacheKey]:
        """Keys of the modules on disk, by module name."""
        found = {}
        for meta in sorted(self.root.glob("fo_*.json")):
            try:
                found[meta.stem] = CacheKey(**json.loads(meta.read_text()))
            except (OSError, ValueError, TypeError):
                continue
        return found

    def describe(self, key: CacheKey) -> str:
        """Whether ``key`` is cached and, for a miss, how the nearest entry on disk differs."""
        path, _ = self.paths(key)
        if key.digest in self._modules or path.exists():
            return f"hit: {path}\n{key.describe()}"
        same_family = [k for k in self.entries().values() if k.family == key.family]
        if not same_family:
            return (f"miss: no {key.family} kernel in {self.root} yet (first use, or a new "
                    f"cache directory)\n{key.describe()}")
        nearest = min(same_family, key=lambda other: len(key.differences(other)))
        diffs = key.differences(nearest)
        shown = ", ".join(
            f"{field} ({'<changed>' if field == 'source_sha256' else repr(new)} vs cached "
            f"{'<other>' if field == 'source_sha256' else repr(old)})"
            for field, (new, old) in diffs.items())
        return (f"miss: nearest cached entry {nearest.module_name} differs in: {shown}\n"
                f"{key.describe()}")


_CACHES: Dict[Path, KernelCache] = {}


def kernel_cache() -> KernelCache:
    """The process-wide cache of the configured directory."""
    root = default_cache_dir()
    if root not in _CACHES:
        _CACHES[root] = KernelCache(root)
    return _CACHES[root]
