# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""SlimCache's use counting and hot-set ranking, in loops without the GIL.

A staging thread counts every batch it stages (the cache's counters and the uses that pick the
next epoch's hot set). In NumPy that is five passes with temporaries over the batch's ids, with
the GIL taken between them, on a thread that races the training thread for the GIL and for
cores busy with sampling; here it is one loop over the unique ids and one over the inverse.

At an epoch's start the training thread ranks a table's rows by those uses, once per planned hot
set: two passes over the counts (a histogram, then each chosen row written to its count's place),
where NumPy's partition, masks and sort took 0.6 s per 50 M rows on 2 cores.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t

import numpy as np

ctypedef fused index_t:
    int32_t
    int64_t

ctypedef fused count_t:
    int32_t
    int64_t


def count_uses(const int64_t[::1] values, const index_t[::1] inverse, bint pad, int32_t[::1] seen=None,
               const int32_t[::1] slot_of=None, const uint8_t[::1] hot=None, int bit=0):
    """``(requested, hits)`` of one batch's lookup, adding one use per id to ``seen``.

    ``values``: the batch's sorted unique ids, ``-1`` first where ``pad`` (padding); ``inverse``:
    each requested entry's position in ``values``. ``requested`` counts the entries that are not
    padding; ``hits`` the valid ids with a slot in ``slot_of`` (``-1`` = absent), or else with
    ``bit`` set in ``hot`` (one bit per planned hot set; 0 without either). ``seen`` (may be
    None) gains 1 at each valid id (ids are distinct, so no use is lost); every valid id must be a
    row of ``seen``, ``slot_of`` and ``hot`` (the caller checks the range).
    """
    cdef Py_ssize_t n = values.shape[0], m = inverse.shape[0], i
    cdef Py_ssize_t start = 1 if pad else 0
    cdef int64_t requested = m, hits = 0
    cdef bint has_seen = seen is not None, has_map = slot_of is not None, has_hot = hot is not None
    cdef uint8_t mask = <uint8_t>(1 << bit) if 0 <= bit < 8 else 0
    if n > start:  # the largest id is the last
        for what, rows in (("seen", seen.shape[0] if has_seen else -1), ("slot_of", slot_of.shape[0] if has_map else -1),
                           ("hot", hot.shape[0] if has_hot else -1)):
            if 0 <= rows <= values[n - 1]:
                raise IndexError(f"id {values[n - 1]} is outside {what}'s {rows} rows")
    with nogil:
        if pad:
            for i in range(m):
                if inverse[i] == 0:
                    requested -= 1
        for i in range(start, n):
            if has_seen:
                seen[values[i]] += 1
            if has_map:
                if slot_of[values[i]] >= 0:
                    hits += 1
            elif has_hot and hot[values[i]] & mask:
                hits += 1
    return int(requested), int(hits)


def rank_hot(const count_t[::1] counts, Py_ssize_t capacity, int64_t top):
    """The ids of at most ``capacity`` rows with the largest positive ``counts``, by count
    (descending), then id: a static hot set. ``top``: the largest count (the histogram has
    ``top + 1`` bins, so the caller bounds it); every count must be in ``[0, top]``."""
    cdef Py_ssize_t n = counts.shape[0], i
    cdef int64_t v, c, cut = 0, chosen = 0, room = 0, fits, end, take
    if top < 0:
        raise ValueError(f"top must be non-negative (got {top})")
    hist_arr = np.zeros(top + 1, dtype=np.int64)
    cdef int64_t[::1] hist = hist_arr
    cdef bint bad = False
    with nogil:
        for i in range(n):  # no branch on the count: about half the rows of an epoch are unused
            c = counts[i]
            bad |= (c < 0) | (c > top)
            hist[c if 0 <= c <= top else 0] += 1
        if not bad:
            # the cut: rows counted above it all fit; rows at it fill what is left, lower ids first
            v = top
            while v > 0:
                if chosen + hist[v] > capacity:
                    cut, room = v, capacity - chosen
                    break
                chosen += hist[v]
                v -= 1
            # hist[v] becomes the place of count v's next row (most used first)
            c = 0
            v = top
            while v > cut:
                fits = hist[v]
                hist[v] = c
                c += fits
                v -= 1
            hist[cut] = c
    if bad:
        raise ValueError(f"a count is outside [0, top={top}]")
    end = chosen + (room if cut > 0 else 0)
    out_arr = np.empty(end + 1, dtype=np.int64)  # the last place takes the rows left out
    cdef int64_t[::1] out = out_arr
    with nogil:
        for i in range(n):
            c = counts[i]
            take = (c > cut) | ((c == cut) & (cut > 0) & (hist[cut] < end))
            out[hist[c] if take else end] = i
            hist[c] += take
    return out_arr[:end]
