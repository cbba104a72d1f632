"""Generated kernels against the float64 references: forward and backward, every variant.

Cases cover each value of each axis (K in 1, 7, 10, 32; H in 1, 2, 4; d in 16, 50, 64, 100;
mask / CSR / all valid; dense / indexed / mixed; both backward modes; dropout on and off) without
the full cross product, which the interpreter could not run quickly. Every masked case has a row
with no valid neighbor and a row with all of them; outputs are NaN-poisoned before each launch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastopt.codegen as cg
import fastopt.config as fconfig
from codegen_inputs import as_double, neighbors, randn, rel_error, table_index
from fastopt.codegen import kernels, reference
from fastopt.codegen.families import segment_reduce
from fastopt.codegen.families.temporal_attention import checks
from fastopt.codegen.families.temporal_attention.reference import attention_dropout

pytestmark = pytest.mark.usefixtures("triton_backend")

TOL = 1e-4

# (M, K, H, d, form, keys, values, dropout_p, backward_mode)
ATTENTION_CASES = [
    (4, 1, 1, 16, "mask", "dense", "dense", 0.0, "deterministic"),
    (5, 7, 2, 50, "csr", "indexed", "indexed", 0.0, "deterministic"),
    (4, 10, 4, 64, "none", "indexed", "dense", 0.0, "atomic"),
    (3, 32, 2, 100, "mask", "indexed", "indexed", 0.0, "atomic"),
    (6, 10, 2, 50, "csr", "dense", "dense", 0.25, "deterministic"),
    (4, 7, 1, 100, "mask", "dense", "indexed", 0.0, "deterministic"),
    (3, 32, 4, 16, "csr", "indexed", "indexed", 0.5, "deterministic"),
    (8, 1, 2, 64, "csr", "indexed", "indexed", 0.0, "atomic"),
    (5, 10, 1, 50, "mask", "indexed", "indexed", 0.3, "atomic"),
    (6, 10, 2, 50, "mask", "indexed", "shared", 0.2, "deterministic"),  # one index for k and v
    (3, 20, 2, 50, "mask", "indexed", "indexed", 0.0, "deterministic"),  # slot loop, aligned rows
    (3, 40, 2, 100, "csr", "indexed", "indexed", 0.0, "atomic"),  # heuristic splits the heads
]


def _attention_inputs(case, device, dtype=torch.float32, seed=0):
    rows, slots, heads, dim, form, keys, values, _, _ = case
    gen = torch.Generator().manual_seed(seed)
    table_rows = max(2, rows * slots // 3)
    q = randn(rows, heads, dim, generator=gen, device=device, dtype=dtype)

    def side(kind):
        if kind == "dense":
            return randn(rows, slots, heads, dim, generator=gen, device=device, dtype=dtype), None
        return (randn(table_rows, heads, dim, generator=gen, device=device, dtype=dtype),
                table_index(rows, slots, table_rows, gen, device))

    k, k_index = side(keys)
    v, v_index = side(values)
    if values == "shared":
        v_index = k_index
    valid = neighbors(rows, slots, gen, device).form(form)
    return (q, k, v), dict(k_index=k_index, v_index=v_index, **valid)


def _check_against_reference(op, ref_op, tensors, kwargs, tol=TOL):
    """Forward and backward of ``op`` (kernels) against ``ref_op`` on float64 copies."""
    out = op(*tensors, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64).to(out)
    grads = torch.autograd.grad(out, tensors, grad)
    doubles = [as_double(t) for t in tensors]
    ref = ref_op(*doubles, **kwargs)
    ref_grads = torch.autograd.grad(ref, doubles, grad.double())
    assert rel_error(out, ref) < tol, "forward"
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_error(g, r) < tol, f"gradient of input {i}"
    return out, grads


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(map(str, c)))
def test_temporal_attention_matches_reference(case, device):
    tensors, kwargs = _attention_inputs(case, device)
    kwargs.update(dropout_p=case[7], seed=11)
    with fconfig.patch(kernels__backward_mode=case[8]):
        out, _ = _check_against_reference(cg.temporal_attention, reference.temporal_attention,
                                          tensors, kwargs)
    if "mask" in kwargs or "indptr" in kwargs:
        assert torch.all(out[0] == 0), "a row without valid neighbors must give zeros"


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(map(str, c)))
def test_two_pass_softmax_matches_reference(case, device):
    """The forward's softmax in two passes over unrolled slots: same results and dropout mask
    (cases above 32 slot-heads keep the online softmax of the slot loop)."""
    tensors, kwargs = _attention_inputs(case, device)
    kwargs.update(dropout_p=case[7], seed=11)
    with fconfig.patch(kernels__backward_mode=case[8], kernels__attention_softmax="two_pass"):
        out, _ = _check_against_reference(cg.temporal_attention, reference.temporal_attention,
                                          tensors, kwargs)
    with fconfig.patch(kernels__attention_softmax="online"):
        online = cg.temporal_attention(*tensors, **kwargs)
    assert rel_error(out, online) < TOL, "two passes and the online softmax disagree"
    if "mask" in kwargs or "indptr" in kwargs:
        assert torch.all(out[0] == 0), "a row without valid neighbors must give zeros"


@pytest.mark.parametrize("case", [ATTENTION_CASES[i] for i in (0, 1, 3, 4, 9, 10, 11)],
                         ids=lambda c: "-".join(map(str, c)))
def test_shared_attention_matches_reference(case, device):
    """Keys and values with a feature block shared by the heads (S = 12): kernels against the
    float64 reference, values and all five gradients, every backward mode; all heads share a
    program even where the heuristic would split them (K = 40, d = 100)."""
    tensors, kwargs = _attention_inputs(case, device)
    rows, slots, _, _, _, _, _, dropout_p, mode = case
    gen = torch.Generator().manual_seed(9)
    sq = randn(rows, tensors[0].shape[1], 12, generator=gen, device=device, dtype=torch.float32)
    se = randn(rows, slots, 12, generator=gen, device=device, dtype=torch.float32)
    inputs = (*tensors, sq, se)
    kwargs = dict(kwargs, scale=0.3, dropout_p=dropout_p, seed=11)
    with fconfig.patch(kernels__backward_mode=mode):
        outs = cg.shared_attention(*inputs, **kwargs)
        weights = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), inputs)
    doubles = [as_double(t) for t in inputs]
    refs = reference.shared_attention(*doubles, **kwargs)
    ref_grads = torch.autograd.grad(sum((o * w.double()).sum() for o, w in zip(refs, weights)),
                                    doubles)
    for got, want in zip((*outs, *grads), (*refs, *ref_grads)):
        assert rel_error(got, want) < TOL


@pytest.mark.parametrize("dim,two_pass", [(50, True), (100, False)])
def test_auto_softmax_takes_two_passes_while_the_value_rows_fit(dim, two_pass):
    """"auto": two passes for K=10, H=2, d=50 on one warp (40 values per thread), the online
    softmax for d=100 (80 per thread); the backward is the same either way."""
    spec = dict(K=10, H=2, D=dim, k_stride=2 * dim, v_stride=2 * dim, dk_stride=2 * dim,
                dv_stride=2 * dim, dtype="tl.float32", acc="tl.float32", mask_form="mask",
                k_indexed=True, v_indexed=True, dropout=False, dropout_bits=24,
                seed_in_memory=False, rows=1, block_m=1, block_k=16, block_d=128, block_h=2,
                num_warps=1, gather_eviction="", write_coef=False, align=4, shared_index=True, shared_dim=0)
    forward = kernels.render("temporal_attention", stage="forward", backward_mode="", softmax="auto", **spec)
    assert ("softmax in two passes" in forward) is two_pass
    assert ("for j in tl.static_range(10)" in forward) is not two_pass
    backward = kernels.render("temporal_attention", stage="backward", backward_mode="atomic",
                              grad_dtype="tl.float32", **spec)
    assert "softmax in two passes" not in backward


@pytest.mark.parametrize("dim,heads,align,aligned", [
    (50, 2, 4, True),     # head 1 starts at element 50: read from 48
    (100, 2, 4, False),   # every head starts on a 16-byte boundary already
    (50, 2, 1, False),    # config.kernels.aligned_rows off
    (51, 4, 4, False),    # head 3 would read 208 > 204 elements of its row
    (50, 1, 4, False),    # a 50-element row is not a whole number of vectors
])
def test_aligned_rows_only_where_every_head_stays_in_its_row(dim, heads, align, aligned):
    """Heads off a 16-byte boundary are read from the boundary below (whole vectors), and only
    where every span stays inside its row and every row length and stride is whole vectors."""
    width = heads * dim
    spec = dict(K=10, H=heads, D=dim, k_stride=width, v_stride=width, dk_stride=width,
                dv_stride=width, dtype="tl.float32", acc="tl.float32", mask_form="mask",
                k_indexed=True, v_indexed=True, dropout=False, dropout_bits=24,
                seed_in_memory=False, rows=1, block_m=1, block_k=16, block_d=128,
                block_h=heads, num_warps=1, gather_eviction="", write_coef=False, align=align,
                shared_index=False, softmax="auto", shared_dim=0)
    for stage, extra in (("forward", dict(backward_mode="")),
                         ("backward", dict(backward_mode="atomic", grad_dtype="tl.float32"))):
        source = kernels.render("temporal_attention", stage=stage, **extra, **spec)
        assert ("span_ok" in source) is aligned, stage


def test_compiled_kernels_report_their_registers(device):
    """compiled_resources() lists what this process compiled: on a GPU, the attention kernels
    with their registers per thread; the interpreter compiles nothing."""
    tensors, kwargs = _attention_inputs(ATTENTION_CASES[1], device)
    cg.temporal_attention(*tensors, **kwargs)
    found = [r for r in kernels.compiled_resources() if r["family"] == "temporal_attention"]
    if device.type == "cpu":
        assert found == []
        return
    forward = [r for r in found if r["stage"] == "forward" and r["shape"] == (7, 2, 50)]
    assert forward and all(r["n_regs"] > 0 and r["n_spills"] >= 0 for r in forward)
    assert forward[0]["mapping"]["num_warps"] >= 1


def test_forward_saves_log_sum_exp(device):
    tensors, kwargs = _attention_inputs(ATTENTION_CASES[1], device)
    out, lse = torch.ops.fastopt.temporal_attention(*tensors, None, kwargs["indptr"],
                                                    kwargs["k_index"], kwargs["v_index"], 0.3,
                                                    0.0, 0)
    doubles = [t.detach().double() for t in tensors]
    _, ref_lse = reference.temporal_attention_forward(
        *doubles, indptr=kwargs.get("indptr"), k_index=kwargs["k_index"],
        v_index=kwargs["v_index"], scale=0.3)
    finite = torch.isfinite(ref_lse.cpu())
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert rel_error(lse.cpu()[finite], ref_lse.cpu()[finite]) < TOL
    assert torch.all(lse.cpu()[~finite] == float("inf"))


@pytest.mark.parametrize("form", ["mask", "csr", "none"])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("indexed,mode", [(False, "deterministic"), (True, "deterministic"),
                                          (True, "atomic")])
def test_masked_aggregate_matches_reference(form, reduce, indexed, mode, device):
    gen = torch.Generator().manual_seed(1)
    rows, slots, features, table_rows = 6, 10, 50, 9
    if indexed:
        x = randn(table_rows, 2, features, generator=gen, device=device)
        kwargs = dict(index=table_index(rows, slots, table_rows, gen, device))
    else:
        x = randn(rows, slots, features, generator=gen, device=device)
        kwargs = {}
    kwargs.update(neighbors(rows, slots, gen, device).form(form), reduce=reduce)
    with fconfig.patch(kernels__backward_mode=mode):
        out, _ = _check_against_reference(cg.masked_aggregate, reference.masked_aggregate, (x,),
                                          kwargs)
    if form != "none":
        assert torch.all(out[0] == 0)


def test_time_encode_matches_reference(device):
    gen = torch.Generator().manual_seed(2)
    dt = (torch.rand(70, 3, generator=gen) * 100).to(device).requires_grad_()
    w = randn(100, generator=gen, device=device, scale=0.1)
    b = randn(100, generator=gen, device=device)
    _check_against_reference(cg.time_encode, reference.time_encode, (dt, w, b), {})


def test_time_encode_is_accurate_at_the_phases_of_real_time_gaps(device):
    """Seconds between events times TGN's frequencies (1 down to 1e-9) give phases up to 3e6: the
    kernel's error stays within the float32 rounding of the phase, as torch's eager encoding's does
    (a cosine approximated in hardware would be off by far more there)."""
    gen = torch.Generator().manual_seed(3)
    dt = torch.rand(4000, generator=gen) * 3e6
    dt[:100] = torch.rand(100, generator=gen)  # and small gaps
    w = torch.from_numpy(1.0 / 10 ** np.linspace(0, 9, 100, dtype=np.float32))
    b = randn(100, generator=gen, device="cpu", scale=0.1)
    out = cg.time_encode(dt.to(device), w.to(device), b.to(device)).cpu().double()
    product = dt.double()[:, None] * w.double()
    truth = torch.cos(product + b.double())
    # float32 rounds the product and the sum: half an ulp each, about |x| * 2^-24
    bound = (product.abs() + (product + b.double()).abs()) * 2.0 ** -24 + 4e-6
    eager = torch.cos(dt[:, None] * w + b).double()
    assert torch.all((eager - truth).abs() <= bound)  # the bound holds for torch itself
    excess = ((out - truth).abs() - bound).max()
    assert excess <= 0, f"time encoding off by {float(excess):.3g} beyond float32 rounding"


def test_indexed_backward_is_deterministic(device):
    case = (8, 10, 2, 50, "csr", "indexed", "indexed", 0.0, "deterministic")
    tensors, kwargs = _attention_inputs(case, device)
    runs = []
    for _ in range(2):
        out = cg.temporal_attention(*tensors, **kwargs)
        runs.append(torch.autograd.grad(out.sum(), tensors))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_dropout_determinism_and_seed(device):
    case = (5, 10, 2, 16, "none", "indexed", "indexed", 0.3, "deterministic")
    tensors, kwargs = _attention_inputs(case, device)
    first = cg.temporal_attention(*tensors, dropout_p=0.3, seed=1, **kwargs)
    again = cg.temporal_attention(*tensors, dropout_p=0.3, seed=1, **kwargs)
    other = cg.temporal_attention(*tensors, dropout_p=0.3, seed=2, **kwargs)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_dropout_keeps_expected_fraction(device):
    """Uniform attention over one-hot values exposes every keep decision in the output."""
    rows, slots, heads, p = 8, 32, 2, 0.3
    q = torch.zeros(rows, heads, slots, device=device)
    eye = torch.eye(slots, device=device)
    v = eye[None, :, None, :].expand(rows, slots, heads, slots).contiguous()
    k = torch.zeros_like(v)
    out = cg.temporal_attention(q, k, v, dropout_p=p, seed=123)
    kept = out.cpu() * slots * (1 - p)
    assert torch.allclose(kept, kept.round(), atol=1e-4), "each weight is dropped or scaled"
    keep = kept.round()
    draws = keep.numel()
    fraction = keep.mean().item()
    assert abs(fraction - (1 - p)) < 4 * ((p * (1 - p)) / draws) ** 0.5
    expected = attention_dropout(123, p, rows, heads, slots, torch.device("cpu"))
    assert torch.equal(keep.bool(), expected)


@pytest.mark.parametrize("dim", [64, 100])  # 100: head 1 starts off a 16-byte boundary
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype, dim, device):
    case = (4, 10, 2, dim, "csr", "indexed", "indexed", 0.0, "deterministic")
    tensors, kwargs = _attention_inputs(case, device, dtype=dtype)
    out = cg.temporal_attention(*tensors, **kwargs)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out.float().sum(), tensors)
    doubles = [as_double(t) for t in tensors]
    ref = reference.temporal_attention(*doubles, **kwargs)
    ref_grads = torch.autograd.grad(ref.sum(), doubles)
    tol = 1e-2 if dtype == torch.float16 else 2e-2
    assert rel_error(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        assert rel_error(g, r) < tol


def test_gradcheck_through_kernels(device):
    """float64 kernels (float64 accumulation) pass gradcheck, indexed keys and CSR rows."""
    gen = torch.Generator().manual_seed(4)
    rows, slots, heads, dim, table_rows = 3, 3, 2, 4, 4
    q = randn(rows, heads, dim, generator=gen, device=device, dtype=torch.float64)
    k = randn(table_rows, heads, dim, generator=gen, device=device, dtype=torch.float64)
    v = randn(table_rows, heads, dim, generator=gen, device=device, dtype=torch.float64)
    index = table_index(rows, slots, table_rows, gen, device)
    indptr = torch.tensor([0, 2, 2, 5], device=device)

    def fn(q, k, v):
        return cg.temporal_attention(q, k, v, indptr=indptr, k_index=index, v_index=index,
                                     dropout_p=0.2, seed=9)

    with fconfig.patch(kernels__poison_outputs=False):
        assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("knobs", [
    dict(kernels__heads_per_program=1),
    dict(kernels__heads_per_program=2, kernels__rows_per_program=3),
    dict(kernels__rows_per_program=2, kernels__block_k=4, kernels__num_warps=2),
    dict(kernels__block_m=2, kernels__rows_per_program=3, kernels__heads_per_program=2),
    dict(kernels__block_m=1),
    dict(kernels__gather_eviction="evict_last"),
    dict(kernels__attention_softmax="two_pass", kernels__heads_per_program=2,
         kernels__rows_per_program=2, kernels__block_m=2),
    dict(kernels__attention_softmax="online", kernels__heads_per_program=2,
         kernels__rows_per_program=3, kernels__block_m=2),
], ids=["one-head-per-program", "head-pairs-three-rows", "two-rows-k-blocks-of-4",
        "row-tiles-of-2-three-per-program", "one-row-tiles", "l2-hints", "two-pass-head-pairs",
        "online-head-pairs-three-row-tiles"])
def test_thread_mappings_agree(knobs, device):
    """Split heads, several rows per program and several slot blocks give the same results."""
    case = (7, 10, 4, 50, "mask", "indexed", "indexed", 0.2, "deterministic")
    tensors, kwargs = _attention_inputs(case, device)
    kwargs.update(dropout_p=0.2, seed=3)
    with fconfig.patch(**knobs):
        _check_against_reference(cg.temporal_attention, reference.temporal_attention, tensors,
                                 kwargs)


def test_op_overrides_map_the_attention_and_its_reduction(device):
    """An op_overrides entry of the attention at its (K, H, d) maps its forward, its backward and
    the segmented reduction of that backward, and the results still match the reference."""
    case = (7, 10, 4, 50, "mask", "indexed", "indexed", 0.0, "deterministic")
    tensors, kwargs = _attention_inputs(case, device)
    entry = "temporal_attention@10x4x50:block_m=2,rows_per_program=3,heads_per_program=2"
    with fconfig.patch(kernels__op_overrides=entry):
        _check_against_reference(cg.temporal_attention, reference.temporal_attention, tensors, kwargs)
    used = {(key[0], dict(key[-1]).get("stage", "")): hit.cfg for key, hit in kernels._SPECIALIZED.items()
            if key[2] == (10, 4, 50) and entry in key[3]}
    assert set(used) == {("temporal_attention", "forward"), ("temporal_attention", "backward"),
                         ("segment_reduce", "")}
    assert all((c.block_m, c.rows_per_program) == (2, 3) for c in used.values())
    assert used[("temporal_attention", "forward")].heads_per_program == 2


@pytest.mark.parametrize("mode", ["deterministic", "atomic"])
def test_more_slots_than_the_unrolled_loop(mode, device):
    """Above 32 slot-heads the slots run as a loop rather than unrolled: same results."""
    case = (5, 40, 2, 16, "mask", "indexed", "indexed", 0.0, mode)
    tensors, kwargs = _attention_inputs(case, device)
    with fconfig.patch(kernels__backward_mode=mode):
        _check_against_reference(cg.temporal_attention, reference.temporal_attention, tensors,
                                 kwargs)


@pytest.mark.parametrize("mode", ["deterministic", "atomic"])
def test_keys_and_values_sharing_one_index(mode, device):
    """One index for both tables (SlimCache's layout): dk and dv come from one segmented pass."""
    gen = torch.Generator().manual_seed(6)
    rows, slots, heads, dim, table_rows = 9, 10, 2, 50, 30
    q = randn(rows, heads, dim, generator=gen, device=device)
    k = randn(table_rows, heads, dim, generator=gen, device=device)
    v = randn(table_rows, heads, dim, generator=gen, device=device)
    index = table_index(rows, slots, table_rows, gen, device)
    kwargs = dict(k_index=index, v_index=index, **neighbors(rows, slots, gen, device).form("mask"))
    with fconfig.patch(kernels__backward_mode=mode):
        _check_against_reference(cg.temporal_attention, reference.temporal_attention, (q, k, v),
                                 kwargs)


@pytest.mark.parametrize("table_rows", [7, 1 << 15, (1 << 15) + 1, 1 << 16, (1 << 16) + 1])
def test_segments_group_slots_by_row_in_slot_order(table_rows):
    """The inverse index (stable sort + CSR) for every sort-key width: int16, shifted int16, int32."""
    gen = torch.Generator().manual_seed(table_rows)
    index = torch.randint(0, table_rows, (50, 10), generator=gen)
    index[0, :3] = torch.tensor([0, table_rows - 1, table_rows - 1])
    perm, segptr = segment_reduce.Segments().of(index, table_rows)
    flat = index.reshape(-1)
    assert segptr.shape == (table_rows + 1,) and int(segptr[0]) == 0
    assert int(segptr[-1]) == flat.numel()
    counts = torch.bincount(flat, minlength=table_rows)
    assert torch.equal(segptr[1:] - segptr[:-1], counts)
    expected = torch.argsort(flat, stable=True)
    assert torch.equal(perm, expected)


@pytest.mark.parametrize("heads,knobs", [
    (3, {}), (6, dict(kernels__heads_per_program=4)), (3, dict(kernels__heads_per_program=2)),
], ids=["three-heads-one-program", "six-heads-groups-of-4", "three-heads-groups-of-2"])
@pytest.mark.parametrize("mode", ["deterministic", "atomic"])
@pytest.mark.parametrize("keys", ["indexed", "dense"])
def test_head_counts_that_are_not_powers_of_two(heads, knobs, mode, keys, device):
    """No phantom head: a program's heads beyond H neither compute nor write (LSE, coefficients)."""
    case = (4, 3, heads, 8, "csr", keys, keys, 0.0, mode)
    tensors, kwargs = _attention_inputs(case, device)
    with fconfig.patch(kernels__backward_mode=mode, **knobs):
        _check_against_reference(cg.temporal_attention, reference.temporal_attention, tensors,
                                 kwargs)


@pytest.mark.parametrize("keys", ["dense", "indexed"])
@pytest.mark.parametrize("mode", ["deterministic", "atomic"])
def test_keys_and_values_as_column_blocks_of_one_product(keys, mode, device):
    """Keys and values projected together: column blocks of one ``[..., 2*H*d]`` tensor are read
    in place (row stride 2*H*d) and give the contiguous results, gradients included."""
    rows, slots, heads, dim = 5, 7, 2, 50
    gen = torch.Generator().manual_seed(4)
    q = randn(rows, heads, dim, generator=gen, device=device)
    mask = neighbors(rows, slots, gen, device).mask
    width = heads * dim
    if keys == "dense":
        kv = randn(rows, slots, 2 * width, generator=gen, device=device)
        index = None
        k, v = (block.view(rows, slots, heads, dim) for block in kv.split(width, -1))
    else:
        kv = randn(rows * slots // 3, 2 * width, generator=gen, device=device)
        index = table_index(rows, slots, kv.shape[0], gen, device)
        k, v = (block.view(-1, heads, dim) for block in kv.split(width, -1))
    assert checks.row_stride(k, index is None) == 2 * width and not k.is_contiguous()

    def fused(q, kv):
        k, v = (b.view(*kv.shape[:-1], heads, dim) for b in kv.split(width, -1))
        return cg.temporal_attention(q, k, v, mask, k_index=index, v_index=index)

    def oracle(q, kv):
        k, v = (b.reshape(*kv.shape[:-1], heads, dim) for b in kv.split(width, -1))
        return reference.temporal_attention(q, k, v, mask, k_index=index, v_index=index)

    with fconfig.patch(kernels__backward_mode=mode):
        _check_against_reference(fused, oracle, (q, kv), {})


def test_row_stride_of_key_layouts():
    t = torch.zeros(4, 3, 2, 5)
    assert checks.row_stride(t, True) == 10
    assert checks.row_stride(torch.zeros(4, 3, 30)[..., :10].view(4, 3, 2, 5), True) == 30
    assert checks.row_stride(t.transpose(0, 1), True) is None  # slots not evenly spaced
    assert checks.row_stride(torch.zeros(4, 3, 5, 2).transpose(-1, -2), True) is None
    assert checks.row_stride(torch.zeros(4, 1, 2, 5), True) == 10
    assert checks.row_stride(torch.zeros(7, 20)[:, 5:15].view(7, 2, 5), False) == 20
    assert checks.key_rows(t.transpose(0, 1), True).is_contiguous()
    assert checks.row_stride(torch.zeros(4, 0, 2, 5), True) == 10  # nothing to read


def test_attention_over_no_slots_gives_zeros(device):
    q = randn(3, 2, 5, generator=torch.Generator().manual_seed(0), device=device)
    k = torch.zeros(3, 0, 2, 5, device=device)
    mask = torch.zeros(3, 0, dtype=torch.bool, device=device)
    assert torch.equal(cg.temporal_attention(q, k, k, mask), torch.zeros_like(q))


def test_key_and_value_gradients_fill_one_buffer_for_the_projection(device):
    """Keys and values as column blocks of one product (passes.split_linear_lowering's
    column_blocks): the attention's backward writes both gradients into one buffer, which the
    blocks' backward hands on whole (no concatenation), with the values of the unfused chain."""
    from fastopt.passes import split_linear_lowering as lowering

    rows, slots, heads, dim = 4, 6, 2, 8
    gen = torch.Generator().manual_seed(5)
    q = randn(rows, heads, dim, generator=gen, device=device)
    kv = randn(rows, slots, 2 * heads * dim, generator=gen, device=device)
    mask = neighbors(rows, slots, gen, device).mask
    grad = randn(rows, heads, dim, generator=gen, device=device)
    seen = []
    adjacent = lowering.adjacent_blocks

    def spy(*args):
        seen.append(adjacent(*args))
        return seen[-1]

    lowering.adjacent_blocks = spy
    try:
        k, v = (b.view(rows, slots, heads, dim)
                for b in lowering.column_blocks(kv, (heads * dim, heads * dim)))
        (got,) = torch.autograd.grad(cg.temporal_attention(q, k, v, mask), kv, grad)
    finally:
        lowering.adjacent_blocks = adjacent
    assert len(seen) == 1 and seen[0] is not None
    k, v = (b.reshape(rows, slots, heads, dim) for b in kv.split(heads * dim, -1))
    (want,) = torch.autograd.grad(reference.temporal_attention(q, k, v, mask), kv, grad)
    assert rel_error(got, want) < TOL
