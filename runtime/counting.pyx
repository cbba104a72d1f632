# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""SlimCache's per-batch use counting in one pass without the GIL.

A staging thread counts every batch it stages (the cache's counters and the uses that pick the
next epoch's hot set). In NumPy that is five passes with temporaries over the batch's ids, with
the GIL taken between them, on a thread that races the training thread for the GIL and for
cores busy with sampling; here it is one loop over the unique ids and one over the inverse.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t

import numpy as np

ctypedef fused index_t:
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
