"""SlimCache's use counting (runtime/counting.pyx) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastopt.runtime.blocks import Unique
from fastopt.runtime.counting import count_uses


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(-1, 49), min_size=0, max_size=80), inverse32=st.booleans(),
       with_seen=st.booleans(), with_map=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_count_uses_equals_numpy(ids, inverse32, with_seen, with_map, seed):
    u = Unique.of(torch.tensor(ids, dtype=torch.int64))
    values, inverse = u.values.numpy(), u.inverse.numpy()
    if inverse32:
        inverse = inverse.astype(np.int32)
    pad = bool(values.size and values[0] == -1)
    rng = np.random.default_rng(seed)
    seen = rng.integers(0, 5, 50).astype(np.int32)
    slot_of = np.where(rng.random(50) < 0.4, rng.integers(0, 9, 50), -1).astype(np.int32)
    expected_seen = seen.copy()
    valid = values[int(pad):]
    expected_seen[valid] += 1

    requested, hits = count_uses(values, inverse, pad, seen if with_seen else None,
                                 slot_of if with_map else None)

    assert requested == sum(i >= 0 for i in ids)
    assert hits == (int(np.count_nonzero(slot_of[valid] >= 0)) if with_map else 0)
    if with_seen:
        np.testing.assert_array_equal(seen, expected_seen)


def test_count_uses_rejects_ids_outside_the_tables():
    seen, slot_of = np.zeros(4, np.int32), np.full(4, -1, np.int32)
    with pytest.raises(IndexError, match="id 4 is outside seen's 4 rows"):
        count_uses(np.array([1, 4]), np.array([0, 1]), False, seen, None)
    with pytest.raises(IndexError, match="id 4 is outside slot_of's 4 rows"):
        count_uses(np.array([-1, 4]), np.array([0, 1]), True, None, slot_of)
    assert not seen.any()  # nothing counted before the check


def test_rank_hot_rejects_a_count_above_its_histogram():
    from fastopt.runtime.counting import rank_hot

    with pytest.raises(ValueError, match=r"a count is outside \[0, top=2\]"):
        rank_hot(np.array([1, 3, 0], np.int64), 2, 2)
    assert rank_hot(np.array([0, 2, 1, 2, 0], np.int32), 2, 2).tolist() == [1, 3]
    assert rank_hot(np.array([1, 2, 1, 1], np.int32), 3, 2).tolist() == [1, 0, 2]  # ties at the cut: lower ids
