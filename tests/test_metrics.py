import numpy as np
import pytest

from fastopt.errors import DataError
from fastopt.metrics import average_precision, mrr, roc_auc


def test_average_precision_by_hand():
    # ranked: + (0.9), - (0.8), + (0.7), - (0.1): precision 1 at recall .5, 2/3 at recall 1
    assert average_precision([1, 0, 1, 0], [0.9, 0.8, 0.7, 0.1]) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    assert average_precision([1, 1, 0], [3, 2, 1]) == pytest.approx(1.0)


def test_roc_auc_by_hand():
    # positive/negative pairs ordered correctly: (0.9,0.8) (0.9,0.1) (0.7,0.1); wrong: (0.7,0.8)
    assert roc_auc([1, 0, 1, 0], [0.9, 0.8, 0.7, 0.1]) == pytest.approx(0.75)
    assert roc_auc([0, 1], [1.0, 2.0]) == pytest.approx(1.0)


def test_ties_count_half():
    assert roc_auc([1, 0], [0.5, 0.5]) == pytest.approx(0.5)
    assert average_precision([1, 0], [0.5, 0.5]) == pytest.approx(0.5)
    # one tie among 4 pairs: (2 vs 2) counts 1/2, the rest are ordered correctly
    assert roc_auc([1, 1, 0, 0], [3, 2, 2, 1]) == pytest.approx(3.5 / 4)


def test_mrr_by_hand():
    # first positive beats both negatives: rank 1; second: one higher, one tie -> rank 2.5
    assert mrr([3.0, 1.0], [[1.0, 2.0], [2.0, 1.0]]) == pytest.approx((1 + 1 / 2.5) / 2)


def test_bad_scores():
    with pytest.raises(DataError, match="NaN"):
        roc_auc([1, 0], [np.nan, 1.0])
    with pytest.raises(DataError, match="length"):
        average_precision([1, 0, 1], [0.1, 0.2])
    with pytest.raises(DataError, match=r"\[P, n\]"):
        mrr([1.0, 2.0], [[1.0]])
