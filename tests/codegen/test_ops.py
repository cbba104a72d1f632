"""The custom ops as torch sees them: registration, fake tensors, compile, backend choice, checks."""

from __future__ import annotations

import types

import pytest
import torch

import fastopt.codegen as cg
import fastopt.config as fconfig
from codegen_inputs import neighbors, randn, table_index
from fastopt.codegen import reference
from fastopt.errors import KernelError


def _attention_args(rows=4, slots=5, heads=2, dim=8, table_rows=6, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    q = randn(rows, heads, dim, generator=gen, device="cpu", dtype=dtype)
    k = randn(table_rows, heads, dim, generator=gen, device="cpu", dtype=dtype)
    v = randn(table_rows, heads, dim, generator=gen, device="cpu", dtype=dtype)
    index = table_index(rows, slots, table_rows, gen, "cpu")
    nbrs = neighbors(rows, slots, gen, "cpu")
    return q, k, v, index, nbrs


def test_cpu_default_is_the_reference():
    q, k, v, index, nbrs = _attention_args()
    assert cg.select_backend(q) == "reference"
    out = cg.temporal_attention(q, k, v, nbrs.mask, k_index=index, v_index=index)
    ref = reference.temporal_attention(q, k, v, nbrs.mask, k_index=index, v_index=index)
    assert torch.equal(out, ref)


def test_backend_knob_selects_kernels():
    q = torch.zeros(1, 1, 1)
    with fconfig.patch(kernels__backend="reference"):
        assert cg.select_backend(q) == "reference"
    with fconfig.patch(kernels__backend="triton", kernels__enabled=False):
        assert cg.select_backend(q) == "reference"


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    from fastopt.codegen import library

    monkeypatch.setattr(library, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with fconfig.patch(kernels__backend="triton"):
        with pytest.raises(KernelError, match="TRITON_INTERPRET=1"):
            cg.select_backend(torch.zeros(1))


def test_without_triton_auto_runs_references_and_triton_names_the_package(monkeypatch):
    """triton is optional: where it is missing, "auto" runs the references on CUDA tensors too,
    warning with the extra that installs it, and "triton" is refused naming the package."""
    from fastopt.codegen import library

    monkeypatch.setattr(library, "triton_available", lambda: False)
    on_cuda = types.SimpleNamespace(is_cuda=True, device="cuda:0")  # all select_backend reads
    with fconfig.patch(kernels__backend="auto"):
        with pytest.warns(RuntimeWarning, match=r'triton is not installed.*"fastopt\[gpu\]"'):
            assert cg.select_backend(on_cuda) == "reference"
        assert cg.select_backend(torch.zeros(1)) == "reference"
    with fconfig.patch(kernels__backend="triton"):
        for t in (on_cuda, torch.zeros(1)):
            with pytest.raises(KernelError, match="needs the triton package.*fastopt\\[gpu\\]"):
                cg.select_backend(t)


def test_opcheck_temporal_attention():
    q, k, v, index, nbrs = _attention_args()
    args = (q, k, v, None, nbrs.indptr, index, index, 0.35, 0.2, 3)
    torch.library.opcheck(torch.ops.fastopt.temporal_attention.default, args)


def test_opcheck_masked_aggregate_and_time_encode():
    q, k, _, index, nbrs = _attention_args()
    torch.library.opcheck(torch.ops.fastopt.masked_aggregate.default,
                          (k, nbrs.mask, None, index, "mean"))
    dt = torch.rand(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.fastopt.time_encode.default, (dt, w, b))


def _shared_block(rows=4, slots=5, heads=2, width=3, dtype=torch.float64):
    gen = torch.Generator().manual_seed(5)
    return (randn(rows, heads, width, generator=gen, device="cpu", dtype=dtype),
            randn(rows, slots, width, generator=gen, device="cpu", dtype=dtype))


def test_opcheck_shared_attention():
    q, k, v, index, nbrs = _attention_args()
    sq, se = _shared_block()
    args = (q, k, v, sq, se, nbrs.mask, None, index, index, 0.35, 0.2, 3)
    torch.library.opcheck(torch.ops.fastopt.shared_attention.default, args)


def test_shared_attention_is_attention_over_the_concatenation():
    """Head h attends with [q_h ; sq_h] over [k_j,h ; se_j] and [v_j,h ; se_j] (values and
    gradients), and the reference passes gradcheck."""
    q, k, v, index, nbrs = _attention_args(rows=3, slots=3, dim=3, table_rows=4)
    sq, se = _shared_block(rows=3, slots=3)

    def concatenated(q, k, v, sq, se):
        block = se[:, :, None].expand(-1, -1, q.shape[1], -1)
        out = cg.temporal_attention(torch.cat([q, sq], -1), torch.cat([k[index], block], -1),
                                    torch.cat([v[index], block], -1), indptr=nbrs.indptr,
                                    scale=0.4, dropout_p=0.3, seed=2)
        return out[..., :q.shape[-1]], out[..., q.shape[-1]:]

    def shared(q, k, v, sq, se):
        return cg.shared_attention(q, k, v, sq, se, indptr=nbrs.indptr, k_index=index,
                                   v_index=index, scale=0.4, dropout_p=0.3, seed=2)

    inputs = (q, k, v, sq, se)
    for a, b in zip(shared(*inputs), concatenated(*inputs)):
        torch.testing.assert_close(a, b)
    weights = [torch.randn(t.shape, dtype=t.dtype) for t in shared(*inputs)]
    grads = [torch.autograd.grad(sum((o * w).sum() for o, w in zip(f(*inputs), weights)), inputs)
             for f in (shared, concatenated)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(shared, inputs)


def test_bad_shared_block_names_value_and_fix():
    q, k, v, index, nbrs = _attention_args()
    sq, se = _shared_block()
    with pytest.raises(KernelError, match=r"se has shape \(4, 4, 3\), expected \(4, 5, 3\)"):
        cg.shared_attention(q, k, v, sq, se[:, :4], nbrs.mask, k_index=index, v_index=index)
    with pytest.raises(KernelError, match="sq has dtype torch.float32 but q has torch.float64"):
        cg.shared_attention(q, k, v, sq.float(), se, nbrs.mask, k_index=index, v_index=index)


def test_reference_gradcheck_all_ops():
    q, k, v, index, nbrs = _attention_args(rows=3, slots=3, dim=3, table_rows=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: cg.temporal_attention(q, k, v, indptr=nbrs.indptr, k_index=index,
                                              v_index=index, dropout_p=0.3, seed=2), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda x: cg.masked_aggregate(x, nbrs.mask, index=index, reduce="mean"), (k,))


def test_torch_compile_sees_one_op():
    q, k, v, index, nbrs = _attention_args(dtype=torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k, v):
        return cg.temporal_attention(q, k, v, nbrs.mask, k_index=index, v_index=index).relu()

    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), layer(q, k, v))
    op = torch.ops.fastopt.temporal_attention
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(t in (op, op.default) for t in targets) == 1


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(7, 2, 16)
        k = torch.empty(20, 2, 16)
        index = torch.zeros(7, 10, dtype=torch.int64)
        out, lse = torch.ops.fastopt.temporal_attention(q, k, k, None, None, index, index, 0.25,
                                                        0.0, 0)
        assert out.shape == (7, 2, 16) and lse.shape == (7, 2)
        agg = torch.ops.fastopt.masked_aggregate(k, None, None, index, "sum")
        assert agg.shape == (7, 2, 16)


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(4, 2)), "q must have 3 dimensions"),
    (dict(k=torch.zeros(4, 5, 2, 8, dtype=torch.float32)), "dtype torch.float32 but q has"),
    (dict(k_index=torch.full((4, 5), 6)), "holds 6, outside the table's rows \\[0, 6\\)"),
    (dict(k_index=torch.zeros(4, 5, dtype=torch.int16)), "int16"),
    (dict(mask=torch.ones(4, 5)), "must be bool"),
    (dict(mask=torch.ones(4, 4, dtype=torch.bool)), "expected \\(4, 5\\)"),
    (dict(indptr=torch.tensor([0, 1, 9, 9, 9])), "8 valid neighbors, outside \\[0, K=5\\]"),
    (dict(indptr=torch.tensor([0, 1, 2, 3, 4]), mask=torch.ones(4, 5, dtype=torch.bool)),
     "either mask or indptr"),
    (dict(dropout_p=1.0), "dropout_p must be in \\[0, 1\\)"),
    (dict(seed=2**40), "seed must be an int in \\[0, 2\\*\\*31\\)"),
    (dict(v=torch.zeros(6, 2, 7, dtype=torch.float64)), "heads x dim \\(2, 7\\)"),
])
def test_bad_attention_input_names_value_limit_and_fix(change, match):
    q, k, v, index, _ = _attention_args()
    args = dict(q=q, k=k, v=v, k_index=index, v_index=index)
    args.update(change)
    positional = [args.pop(name) for name in ("q", "k", "v")]
    with pytest.raises(KernelError, match=match):
        cg.temporal_attention(*positional, **args)


def test_bad_aggregate_and_time_encode_inputs():
    with pytest.raises(KernelError, match="reduce must be 'mean' or 'sum'"):
        cg.masked_aggregate(torch.zeros(2, 3, 4), reduce="max")
    with pytest.raises(KernelError, match="dense neighbors need"):
        cg.masked_aggregate(torch.zeros(2, 3))
    with pytest.raises(KernelError, match="b has shape"):
        cg.time_encode(torch.zeros(3), torch.zeros(4), torch.zeros(5))
    with pytest.raises(KernelError, match="dtype torch.int64"):
        cg.time_encode(torch.zeros(3, dtype=torch.int64), torch.zeros(4), torch.zeros(4))


def test_index_range_check_can_be_skipped():
    q, k, v, index, _ = _attention_args()
    bad = torch.full_like(index, 99)
    with fconfig.patch(kernels__check_inputs=False):
        from fastopt.codegen.families.temporal_attention import checks

        checks.check_attention(q, k, v, None, None, bad, bad, None, 0.0, 0)


@pytest.mark.interpreter
def test_eager_path_matches_the_custom_op():
    """The eager fast path and the registered op's autograd give identical values and gradients."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("compares the two paths on the Triton interpreter")
    q, k, v, index, nbrs = _attention_args(dtype=torch.float32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    with fconfig.patch(kernels__backend="triton"):
        eager = cg.temporal_attention(q, k, v, nbrs.mask, k_index=index, v_index=index,
                                      dropout_p=0.2, seed=4)
        eager_grads = torch.autograd.grad(eager, (q, k, v), grad)
        op, _ = torch.ops.fastopt.temporal_attention(q, k, v, nbrs.mask, None, index, index,
                                                     q.shape[-1] ** -0.5, 0.2, 4)
        op_grads = torch.autograd.grad(op, (q, k, v), grad)
    assert eager.grad_fn is not None and "EagerTemporalAttention" in type(eager.grad_fn).__name__
    assert torch.equal(eager, op)
    for a, b in zip(eager_grads, op_grads):
        assert torch.equal(a, b)
