"""Build the Cython extensions of ``fastopt.runtime`` (with OpenMP where the compiler has it)."""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup


def _openmp_flags():
    """Return (compile, link) flags for OpenMP, or empty lists when the compiler lacks it."""
    if os.environ.get("FASTOPT_NO_OPENMP") == "1" or sys.platform == "win32":
        return [], []
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return [], []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        ok = subprocess.call([cc, "-fopenmp", src, "-o", os.path.join(tmp, "omp")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
    return (["-fopenmp"], ["-fopenmp"]) if ok else ([], [])


def _package_include_dir(root):
    """Lay out ``fastopt/runtime`` under ``root`` for Cython's .pxd search.

    Cython finds the declarations of ``fastopt.runtime.sampler`` as ``fastopt/runtime/sampler.pxd``
    on its include path, but the sources live in ``runtime/`` (mapped onto ``fastopt.runtime`` by
    the package-dir table), so the package path is mirrored by a link (or a copy of the .pxd files
    where links are not possible).
    """
    pkg = os.path.join(root, "fastopt")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.pxd"), "w").close()
    target = os.path.join(pkg, "runtime")
    try:
        os.symlink(os.path.abspath("runtime"), target, target_is_directory=True)
    except OSError:
        os.makedirs(target)
        open(os.path.join(target, "__init__.pxd"), "w").close()
        for pxd in glob.glob(os.path.join("runtime", "*.pxd")):
            shutil.copy(pxd, target)
    return root


def _extensions():
    from Cython.Build import cythonize

    cflags, lflags = _openmp_flags()
    exts = [
        Extension(
            "fastopt.runtime." + os.path.splitext(os.path.basename(path))[0],
            [path],
            extra_compile_args=["-O3"] + cflags,
            extra_link_args=lflags,
        )
        for path in sorted(glob.glob(os.path.join("runtime", "*.pyx")))
    ]
    with tempfile.TemporaryDirectory(prefix="fastopt-pxd-") as tmp:
        return cythonize(exts, language_level=3, include_path=[_package_include_dir(tmp)],
                         compile_time_env={"HAVE_OPENMP": bool(cflags)})


setup(ext_modules=_extensions())
