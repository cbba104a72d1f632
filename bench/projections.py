"""Benchmark of the projection products: cuBLAS float32 against the generated matmul kernels.

The products TGAT's first layer runs per step once its keys and values are merged and split
(``passes/split_linear.py``), at 600 roots (6,600 destinations x 10 neighbors = 66,000 rows;
edge features 172 wide without gradient, time encoding 100 wide with gradient, keys and values
2 x 100 wide):

- forward: ``y = x_free @ W_free^T + b`` (172 -> 200) and ``y += x_grad @ W_grad^T`` (100 -> 200);
- backward: ``dx_grad = dy @ W_grad`` (200 -> 100), ``dW_free = dy^T @ x_free`` with the bias
  gradient ``dy.sum(0)`` and ``dW_grad = dy^T @ x_grad`` (reductions over the 66,000 rows).

Each column is the device time of the five products replayed from one CUDA graph (inputs rotated
past the L2), median of ``--iters`` replays: ``torch`` (cuBLAS, float32, TF32 off), then
``codegen.linear``'s kernels at ``tf32x3`` and ``ieee`` for each tile in ``--tiles``. The largest
error of each against float64 products is reported beside it. Prints a table and writes JSON with
the date, GPU, versions, commit and command::

    python bench/projections.py --json bench/results/projections-h200.json
"""

from __future__ import annotations

import argparse
import sys

import torch

import fastopt.config as fconfig
from _meta import write_record
from fastopt.codegen import kernels as codegen_kernels
from kernels import GraphTimer



def products(rows: int) -> list:
    """``(name, M, K, N)`` of each product ``[M, K] @ [K, N]`` at ``rows`` batch rows."""
    return [("fwd_free", rows, 172, 200), ("fwd_grad", rows, 100, 200), ("bwd_dx", rows, 200, 100),
            ("bwd_dw_free", 200, rows, 172), ("bwd_dw_grad", 200, rows, 100)]


def _operands(rows: int, edge: int, time: int, width: int, seed: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    return dict(x_free=randn(rows, edge), x_grad=randn(rows, time), w_free=randn(width, edge),
                w_grad=randn(width, time), bias=randn(width), dy=randn(rows, width))


def _products(mm, ops) -> list:
    y = mm(ops["x_free"], ops["w_free"].t(), bias=ops["bias"])
    y = mm(ops["x_grad"], ops["w_grad"].t(), residual=y)
    dx = mm(ops["dy"], ops["w_grad"])
    dw_free, dbias = mm(ops["dy"].t(), ops["x_free"], row_sums=True)
    dw_grad = mm(ops["dy"].t(), ops["x_grad"])
    return [y, dx, dw_free, dbias, dw_grad]


def _torch_mm(a, b, bias=None, residual=None, row_sums=False):
    if residual is not None:
        return torch.addmm(residual, a, b)
    out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    return (out, a.sum(1)) if row_sums else out


def _max_rel_error(got: list, want: list) -> float:
    return max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/projections.py needs a CUDA GPU; none is available here. Nothing was measured.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    sets = [_operands(args.rows, 172, 100, 200, seed, device) for seed in range(3)]
    want = [[t.double() for t in _products(_torch_mm, {k: v.double() for k, v in s.items()})]
            for s in sets[:1]][0]
    timer = GraphTimer(args.warmup, args.iters, args.reps)
    rows = [{"impl": "torch", "ms": timer(lambda i: _products(_torch_mm, sets[i]), len(sets)),
             "max_rel_error": _max_rel_error(_products(_torch_mm, sets[0]), want)}]
    for tile in args.tiles:
        bm, bn, bk, warps = (int(v) for v in tile.split(","))
        knobs = dict(kernels__matmul_block_m=bm, kernels__matmul_block_n=bn,
                     kernels__matmul_block_k=bk, kernels__matmul_warps=warps)
        for precision in ("tf32x3", "ieee"):
            def mm(a, b, bias=None, residual=None, row_sums=False):
                return codegen_kernels.matmul(a, b, bias=bias, residual=residual,
                                              precision=precision, row_sums=row_sums)
            row = {"impl": f"{precision} {tile}", "tile": tile, "precision": precision}
            try:
                with fconfig.patch(**knobs):
                    row["ms"] = timer(lambda i: _products(mm, sets[i]), len(sets))
                    row["max_rel_error"] = _max_rel_error(_products(mm, sets[0]), want)
            except Exception as exc:  # noqa: BLE001 - a tile that fails is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    print(f"{'implementation':>24} {'ms (5 products)':>16} {'max rel error':>14}")
    for r in rows:
        ms = f"{r['ms']:16.4f}" if "ms" in r else f"{'-':>16}"
        err = f"{r['max_rel_error']:14.2e}" if "max_rel_error" in r else r.get("error", "")
        print(f"{r['impl']:>24} {ms} {err}")
    if args.json:
        write_record(args.json, products=[dict(zip(("name", "M", "K", "N"), p))
                                          for p in products(args.rows)],
                     timing=f"graph replay of {args.reps} calls, median of {args.iters}",
                     results=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
