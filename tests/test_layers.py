"""DESIGN.md's layering, checked on the sources (``passes/README.md`` states it for each folder).

Every ``import`` of a fastopt module, at module level or inside a function, is read from the
source with :mod:`ast`. A folder may import its own modules and the layers its row allows:

* ``errors`` nothing of fastopt, ``config`` only ``errors`` and the ``op_overrides`` syntax (the
  ground floor);
* ``codegen/`` and ``runtime/`` only ``config`` and ``errors``: never ``passes/``, the trainer,
  the models or the top package;
* ``passes/`` also ``fastopt.codegen`` and ``fastopt.runtime``, through their public surface
  (the package and the names in its ``__all__``), never a private module of theirs;
* ``tuner/`` the top package's names (and its lazy-attribute helper), its data, models and
  trainer, ``fastopt.codegen`` and ``fastopt.runtime``: never ``passes/`` (it optimizes models
  through the trainer);
* the imports inside ``passes/`` form no cycle.

The checker runs on the real tree and, to show it can fail, on copies of the tree with one
forbidden import added.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
# source folder -> the package it is imported as (pyproject's package-dir mapping)
FOLDERS = {"fastopt": "fastopt", "runtime": "fastopt.runtime", "codegen": "fastopt.codegen",
           "passes": "fastopt.passes", "tuner": "fastopt.tuner"}
# layer -> the fastopt layers it may import besides itself
ALLOWED = {
    "fastopt.errors": (),
    "fastopt.op_overrides": ("fastopt.errors",),
    "fastopt.config": ("fastopt.errors", "fastopt.op_overrides"),
    "fastopt.codegen": ("fastopt.config", "fastopt.errors"),
    "fastopt.runtime": ("fastopt.config", "fastopt.errors"),
    "fastopt.passes": ("fastopt.config", "fastopt.errors", "fastopt.codegen", "fastopt.runtime"),
    "fastopt.tuner": ("fastopt", "fastopt._lazy", "fastopt.config", "fastopt.errors", "fastopt.data",
                      "fastopt.models", "fastopt.trainer", "fastopt.codegen", "fastopt.runtime"),
}
# allowed entries naming a package whose submodules they do not allow (its own names only)
NAMES_ONLY = ("fastopt",)
# layers whose users see only the package and the names in its __all__
PUBLIC_ONLY = {"fastopt.passes": ("fastopt.codegen", "fastopt.runtime")}


def modules(root: Path) -> Dict[str, Path]:
    """Module name -> source file, for every ``.py`` of the folders under ``root``."""
    found = {}
    for folder, package in FOLDERS.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if folder == "fastopt" and parts and parts[0] in FOLDERS:
                continue  # not a real subfolder of fastopt/
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: Set[str]) -> List[Tuple[str, Tuple[str, ...], int]]:
    """``(module, names, line)`` of every fastopt import in ``path``; ``from fastopt.x import y``
    where ``fastopt.x.y`` is a module counts as an import of ``fastopt.x.y``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names if a.name.split(".")[0] == "fastopt"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "fastopt":
                continue
            names = tuple(a.name for a in node.names)
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            out += [(s, (), node.lineno) for s in subs]
            rest = tuple(n for n in names if f"{base}.{n}" not in known)
            if rest or not subs:
                out.append((base, rest, node.lineno))
    return out


def _layer(module: str) -> str:
    return max((k for k in ALLOWED if module == k or module.startswith(k + ".")), key=len,
               default="")


def _public_names(root: Path, package: str) -> Set[str]:
    init = root / next(f for f, p in FOLDERS.items() if p == package) / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}
    return set()


def violations(root: Path) -> List[str]:
    """Every import under ``root`` that breaks the layering, as ``file:line: what``."""
    found = modules(root)
    known = set(found)
    bad = []
    graph: Dict[str, Set[str]] = {}
    for name, path in found.items():
        layer = _layer(name)
        where = f"{path.relative_to(root)}"
        for target, names, line in imports(name, path, known):
            if name.startswith("fastopt.passes") and target.startswith("fastopt.passes"):
                graph.setdefault(name, set()).add(target)
            if not layer or target == layer or target.startswith(layer + "."):
                continue
            allowed = ALLOWED[layer]
            if not any(target == a or (a not in NAMES_ONLY and target.startswith(a + "."))
                       for a in allowed):
                bad.append(f"{where}:{line}: {layer} imports {target} (allowed: "
                           f"{', '.join(allowed) or 'nothing of fastopt'})")
                continue
            for public in PUBLIC_ONLY.get(layer, ()):
                if target.startswith(public + "."):
                    bad.append(f"{where}:{line}: {layer} imports {target}, a private module of "
                               f"{public} (use its public names)")
                elif target == public and set(names) - _public_names(root, public):
                    bad.append(f"{where}:{line}: {layer} imports {sorted(set(names) - _public_names(root, public))} "
                               f"from {public}, not in its __all__")
    bad += [f"import cycle in fastopt.passes: {' -> '.join(c)}" for c in _cycles(graph)]
    return bad


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle through each module that lies on one (depth-first search)."""
    cycles, done = [], set()

    def visit(node: str, stack: List[str]) -> None:
        if node in stack:
            cycle = stack[stack.index(node):] + [node]
            if not set(cycle) & done:
                cycles.append(cycle)
                done.update(cycle)
            return
        for nxt in sorted(graph.get(node, ())):
            if nxt != node and nxt not in done:
                visit(nxt, stack + [node])

    for start in sorted(graph):
        visit(start, [])
    return cycles


def test_the_tree_keeps_its_layers():
    assert violations(REPO) == []


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the Python sources to break."""
    def not_source(folder: str, names: List[str]) -> List[str]:
        return [n for n in names if n == "__pycache__"
                or not (n.endswith(".py") or (Path(folder) / n).is_dir())]

    for folder in FOLDERS:
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, tmp_path / folder, ignore=not_source)
    return tmp_path


def _add(tree: Path, file: str, line: str) -> None:
    path = tree / file
    path.write_text(path.read_text() + f"\n\ndef _late():\n    {line}\n")


@pytest.mark.parametrize("file,line,found", [
    ("runtime/slimcache.py", "from fastopt.passes import optimize_module",
     "fastopt.runtime imports fastopt.passes"),
    ("runtime/loader.py", "import fastopt.trainer", "fastopt.runtime imports fastopt.trainer"),
    ("codegen/library.py", "from fastopt.models import build_model", "fastopt.codegen imports fastopt.models"),
    ("codegen/cache.py", "from fastopt import Trainer", "fastopt.codegen imports fastopt ("),
    ("runtime/blocks.py", "from ..passes import report", "fastopt.runtime imports fastopt.passes.report"),
    ("fastopt/config.py", "from fastopt.data import load_dataset", "fastopt.config imports fastopt.data"),
    ("fastopt/errors.py", "from fastopt.config import Config", "fastopt.errors imports fastopt.config"),
    ("passes/report.py", "from fastopt.codegen.kernel_config import heuristic_config",
     "a private module of fastopt.codegen"),
    ("passes/aggregate.py", "from fastopt.trainer import Trainer", "fastopt.passes imports fastopt.trainer"),
    ("passes/report.py", "from fastopt.passes import attention", "import cycle in fastopt.passes"),
    ("tuner/space.py", "from fastopt.passes import optimize_module", "fastopt.tuner imports fastopt.passes"),
    ("tuner/records.py", "import fastopt.benchmark", "fastopt.tuner imports fastopt.benchmark"),
])
def test_a_forbidden_import_is_found(tree, file, line, found):
    assert violations(tree) == []
    _add(tree, file, line)
    (problem,) = violations(tree)
    assert found in problem and (file in problem or "cycle" in problem)


def test_private_names_of_a_public_package_are_found(tree):
    _add(tree, "passes/report.py", "from fastopt.codegen import _kernels")
    (problem,) = violations(tree)
    assert "['_kernels'] from fastopt.codegen, not in its __all__" in problem


def _loaded_by(statement: str) -> Set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("statement", ["import fastopt.runtime", "import fastopt.codegen",
                                       "import fastopt.config", "import fastopt.errors"])
def test_low_layers_load_no_passes_models_or_trainer(statement):
    loaded = _loaded_by(statement)
    above = sorted(m for m in loaded if m.startswith(("fastopt.passes", "fastopt.models",
                                                      "fastopt.trainer", "fastopt.data")))
    assert above == []


def test_the_top_package_still_offers_its_surface():
    loaded = _loaded_by("import fastopt; fastopt.Trainer, fastopt.build_model, fastopt.load_dataset")
    assert {"fastopt.trainer", "fastopt.models", "fastopt.data"} <= loaded
    import fastopt
    import fastopt.optimize  # noqa: F401  (the submodule of the same name does not shadow it)

    assert callable(fastopt.optimize) and fastopt.optimize.__module__ == "fastopt.optimize"
    assert set(fastopt.__all__) <= set(dir(fastopt))
    assert all(getattr(fastopt, name) is not None for name in fastopt.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        fastopt.Trainr


# a file above this many lines holds more than one idea: split it along the ideas
MAX_SOURCE_LINES = 600


def test_no_source_file_grows_past_the_limit():
    sources = [p for folder in (*FOLDERS, "bench") for pattern in ("*.py", "*.pyx", "*.pxi")
               for p in (REPO / folder).rglob(pattern)]
    assert len(sources) > 50  # the folders were found
    too_long = {str(p.relative_to(REPO)): n for p in sources
                if (n := len(p.read_text().splitlines())) > MAX_SOURCE_LINES}
    assert too_long == {}, f"split these files (limit {MAX_SOURCE_LINES} lines): {too_long}"
