"""Link-prediction metrics: average precision, ROC AUC (both tie-aware) and MRR."""

from __future__ import annotations

import numpy as np

from fastopt.errors import DataError

__all__ = ["average_precision", "roc_auc", "mrr"]


def _check(y_true, y_score):
    y_true = np.asarray(y_true).astype(bool).ravel()
    y_score = np.asarray(y_score, dtype=np.float64).ravel()
    if y_true.shape != y_score.shape:
        raise DataError(f"labels and scores differ in length ({y_true.size} vs {y_score.size})")
    if not np.isfinite(y_score).all():
        raise DataError("scores contain NaN or infinity; the model diverged (lower the learning rate)")
    return y_true, y_score


def _thresholds(y_true, y_score):
    """True/false positive counts at each distinct score, from the highest down."""
    order = np.argsort(-y_score, kind="mergesort")
    y_true, y_score = y_true[order], y_score[order]
    last = np.r_[np.flatnonzero(np.diff(y_score)), y_true.size - 1]
    tps = np.cumsum(y_true)[last]
    fps = (last + 1) - tps
    return tps, fps


def average_precision(y_true, y_score) -> float:
    """``sum_n (R_n - R_{n-1}) P_n`` over distinct thresholds (tied scores form one threshold)."""
    y_true, y_score = _check(y_true, y_score)
    if not y_true.any():
        return float("nan")
    tps, fps = _thresholds(y_true, y_score)
    precision = tps / (tps + fps)
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def roc_auc(y_true, y_score) -> float:
    """Area under the ROC curve; ties count one half (Mann-Whitney U)."""
    y_true, y_score = _check(y_true, y_score)
    n_pos, n_neg = int(y_true.sum()), int((~y_true).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    tps, fps = _thresholds(y_true, y_score)
    tpr = np.r_[0.0, tps / n_pos]
    fpr = np.r_[0.0, fps / n_neg]
    return float(np.trapezoid(tpr, fpr) if hasattr(np, "trapezoid") else np.trapz(tpr, fpr))


def mrr(pos_score, neg_score) -> float:
    """Mean reciprocal rank of each positive among its negatives (``neg_score`` is ``[P, n]``).

    Rank is ``1 + #(neg > pos) + #(neg == pos) / 2``, the average of the optimistic and
    pessimistic ranks.
    """
    pos = np.asarray(pos_score, dtype=np.float64).reshape(-1, 1)
    neg = np.asarray(neg_score, dtype=np.float64)
    if neg.ndim != 2 or neg.shape[0] != pos.shape[0]:
        raise DataError(f"neg_score must be [P, n] with P = {pos.shape[0]} (got {neg.shape})")
    rank = 1.0 + (neg > pos).sum(1) + 0.5 * (neg == pos).sum(1)
    return float(np.mean(1.0 / rank))
