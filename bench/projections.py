"""Benchmark of the projection products: cuBLAS float32 against the generated matmul kernels.

The products TGAT's first layer runs per step once its keys and values are merged and split
(``passes/split_linear.py``), at 600 roots (6,600 destinations x 10 neighbors = 66,000 rows;
edge features 172 wide without gradient, time encoding 100 wide with gradient, keys and values
2 x 100 wide):

- forward: ``y = x_free @ W_free^T + b`` (172 -> 200) and ``y += x_grad @ W_grad^T`` (100 -> 200);
- backward: ``dx_grad = dy @ W_grad`` (200 -> 100), ``dW_free = dy^T @ x_free`` with the bias
  gradient ``dy.sum(0)`` and ``dW_grad = dy^T @ x_grad`` (reductions over the 66,000 rows), and
  the weight gradients the other way round (``x^T @ dy``, transposed results).

Each product is timed on its own: device time of ``--reps`` calls replayed from one CUDA graph
(inputs rotated past the L2), median of ``--iters`` replays, for ``torch`` (cuBLAS, float32,
TF32 off), ``torch tf32`` (cuBLAS, TF32 on: one rounded pass, for scale) and ``codegen``'s
matmul kernels at ``tf32x3`` and ``ieee`` for each tile in
``--tiles``; the largest error against float64 products is reported beside each. A variant
that raises, or whose error is not finite or exceeds ``--max-error`` (``torch tf32``, rounded on
purpose, is held to finiteness only), is a wrong result: printed as ``WRONG RESULT`` and the
script exits with status 1. Prints a table and writes JSON with the date, GPU, versions, commit
and command::

    python bench/projections.py --json bench/results/projections-h200.json
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import torch

import fastopt.config as fconfig
from _meta import write_record
from fastopt.codegen.families.matmul import matmul
from kernels import GraphTimer
from optimize import cuda_device

# Lower precision on purpose (for scale): their error is recorded, not held to --max-error.
LOWER_PRECISION = ("torch tf32",)


def _operands(rows: int, edge: int, time: int, width: int, seed: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    return dict(x_free=randn(rows, edge), x_grad=randn(rows, time), w_free=randn(width, edge),
                w_grad=randn(width, time), bias=randn(width), dy=randn(rows, width))


# name -> the product on operands ``o`` with a matmul ``mm(a, b, bias=, residual=, row_sums=)``.
# "dw_*_t" are the weight gradients computed transposed (x^T @ dy), the other orientation of the
# same reduction over the batch rows.
PRODUCTS = {
    "fwd_free": lambda mm, o: mm(o["x_free"], o["w_free"].t(), bias=o["bias"]),
    "fwd_grad": lambda mm, o: mm(o["x_grad"], o["w_grad"].t(), residual=o["dy"]),
    "bwd_dx": lambda mm, o: mm(o["dy"], o["w_grad"]),
    "bwd_dw_free": lambda mm, o: mm(o["dy"].t(), o["x_free"], row_sums=True),
    "bwd_dw_grad": lambda mm, o: mm(o["dy"].t(), o["x_grad"]),
    "bwd_dw_free_t": lambda mm, o: mm(o["x_free"].t(), o["dy"]),
    "bwd_dw_grad_t": lambda mm, o: mm(o["x_grad"].t(), o["dy"]),
}


def _torch_mm(a, b, bias=None, residual=None, row_sums=False):
    if residual is not None:
        return torch.addmm(residual, a, b)
    out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    return (out, a.sum(1)) if row_sums else out


def _torch_tf32_mm(*args, **kwargs):
    # cuBLAS on TensorFloat-32 tensor cores: the speed a single rounded pass reaches (less accurate)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return _torch_mm(*args, **kwargs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _flat(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _max_rel_error(got, want) -> float:
    return max(float((g.double() - w).abs().max() / w.abs().max())
               for g, w in zip(_flat(got), _flat(want)))


def accuracy_failures(rows, max_error: float) -> list:
    """The wrong results of the table (empty: every variant is right): a variant that raised, or
    one whose error is not finite or (outside :data:`LOWER_PRECISION`) exceeds ``max_error``."""
    failures = []
    for row in rows:
        for label, cell in row.items():
            if label == "product":
                continue
            where, error = f"{row['product']} {label}", cell.get("max_rel_error")
            if "error" in cell:
                failures.append(f"{where}: raised {cell['error']}")
            elif not math.isfinite(error):
                failures.append(f"{where}: relative error against float64 is {error}")
            elif label not in LOWER_PRECISION and error > max_error:
                failures.append(f"{where}: relative error {error:.3g} against float64 exceeds "
                                f"--max-error {max_error:g}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results to this JSON file")
    parser.add_argument("--rows", type=int, default=66000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=10, help="calls captured per graph")
    parser.add_argument("--tiles", nargs="*", default=["64,64,32,4", "128,64,32,4",
                                                       "128,128,32,8", "64,128,32,4"],
                        metavar="BM,BN,BK,WARPS")
    parser.add_argument("--max-error", type=float, default=1e-4,
                        help="largest relative error against float64 a variant may have "
                             f"(not applied to {', '.join(LOWER_PRECISION)})")
    args = parser.parse_args(argv)
    device = cuda_device("bench/projections.py")
    if device is None:
        return 0
    sets = [_operands(args.rows, 172, 100, 200, seed, device) for seed in range(3)]
    doubles = {k: v.double() for k, v in sets[0].items()}
    timer = GraphTimer(args.warmup, args.iters, args.reps)
    impls = {"torch": (_torch_mm, {}), "torch tf32": (_torch_tf32_mm, {})}
    for tile in args.tiles:
        bm, bn, bk, warps = (int(v) for v in tile.split(","))
        knobs = dict(kernels__matmul_block_m=bm, kernels__matmul_block_n=bn,
                     kernels__matmul_block_k=bk, kernels__matmul_warps=warps)
        for precision in ("tf32x3", "ieee"):
            impls[f"{precision} {tile}"] = (functools.partial(matmul,
                                                              precision=precision), knobs)
    rows = []
    for name, product in PRODUCTS.items():
        want = product(_torch_mm, doubles)
        row = {"product": name}
        for label, (mm, knobs) in impls.items():
            try:
                with fconfig.patch(**knobs):
                    row[label] = {"ms": timer(lambda i: product(mm, sets[i]), len(sets)),
                                  "max_rel_error": _max_rel_error(product(mm, sets[0]), want)}
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                row[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
    labels = list(impls)
    print(f"{'product':>14} " + " ".join(f"{label:>20}" for label in labels))
    for r in rows:
        cells = [f"{r[label]['ms']:9.4f} ({r[label]['max_rel_error']:.0e})" if "ms" in r[label]
                 else "failed" for label in labels]
        print(f"{r['product']:>14} " + " ".join(f"{c:>20}" for c in cells))
    print("ms per product (graph replay), largest error against float64 in parentheses")
    failures = accuracy_failures(rows, args.max_error)
    if args.json:
        write_record(args.json, rows=args.rows,
                     timing=f"graph replay of {args.reps} calls, median of {args.iters}",
                     max_error=args.max_error, accuracy_failures=failures, results=rows)
    for failure in failures:
        print(f"WRONG RESULT: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
