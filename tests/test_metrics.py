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


def cases():
    """Labels and scores with many ties (scores rounded to a few levels) and without."""
    rng = np.random.default_rng(7)
    for n, levels in ((2, 0), (9, 3), (50, 0), (200, 5), (1000, 40), (3000, 0)):
        y = rng.integers(0, 2, n)
        y[0], y[-1] = 1, 0  # both classes present
        s = rng.standard_normal(n) + 0.7 * y
        yield y, (np.round(s * levels) / levels if levels else s)


def brute_auc(y, s) -> float:
    """Mann-Whitney: the share of (positive, negative) pairs ordered right, ties counting half."""
    pos, neg = s[y == 1], s[y == 0]
    wins = sum(float(p > q) + 0.5 * float(p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def brute_ap(y, s) -> float:
    """Precision at each distinct threshold, weighted by the recall it adds."""
    total, ap, previous_recall = int(y.sum()), 0.0, 0.0
    for t in sorted(set(s.tolist()), reverse=True):
        chosen = s >= t
        recall = y[chosen].sum() / total
        ap += (recall - previous_recall) * y[chosen].mean()
        previous_recall = recall
    return ap


def brute_mrr(pos, neg) -> float:
    ranks = []
    for p, row in zip(pos, neg):
        higher = sum(1 for q in row if q > p)
        ties = sum(1 for q in row if q == p)
        ranks.append(1.0 / (1 + higher + ties / 2))
    return sum(ranks) / len(ranks)


@pytest.mark.parametrize("y,s", list(cases()))
def test_against_a_brute_force_reference(y, s):
    if len(y) <= 1000:  # the pairwise reference is quadratic
        assert roc_auc(y, s) == pytest.approx(brute_auc(y, s), abs=1e-12)
    assert average_precision(y, s) == pytest.approx(brute_ap(y, s), abs=1e-12)


@pytest.mark.parametrize("y,s", list(cases()))
def test_against_scikit_learn(y, s):
    metrics = pytest.importorskip("sklearn.metrics")
    assert roc_auc(y, s) == pytest.approx(metrics.roc_auc_score(y, s), abs=1e-12)
    assert average_precision(y, s) == pytest.approx(metrics.average_precision_score(y, s), abs=1e-12)


def test_mrr_against_a_brute_force_reference():
    rng = np.random.default_rng(3)
    pos = np.round(rng.standard_normal(300), 1)
    neg = np.round(rng.standard_normal((300, 7)), 1)  # rounded: ties happen
    assert mrr(pos, neg) == pytest.approx(brute_mrr(pos, neg), abs=1e-12)
