# Included by sampler.pyx: reading a T-CSR row (the candidates of a root before its time) and
# filling one row of a layer's outputs; appending entries while the T-CSR is built.

cdef inline int64_t _lower(const Entry* e, int64_t lo, int64_t hi, double t) noexcept nogil:
    """First index in ``[lo, hi)`` whose time is ``>= t`` (``hi`` if none)."""
    cdef int64_t mid
    while lo < hi:
        mid = lo + ((hi - lo) >> 1)
        if e[mid].ts < t:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline int64_t _advance(const Entry* e, int64_t p, int64_t hi, double t) noexcept nogil:
    """Like :func:`_lower` on ``[p, hi)``, stepping first: chronological roots move a few entries."""
    cdef int64_t steps = 0
    while p < hi and e[p].ts < t:
        p += 1
        steps += 1
        if steps == 8:
            return _lower(e, p, hi, t)
    return p


cdef inline int64_t _retreat(const Entry* e, int64_t lo, int64_t p, double t) noexcept nogil:
    """Like :func:`_lower` on ``[lo, p)`` for a ``p`` whose entry has time ``>= t``: step back
    over the few entries tied with it, then binary-search."""
    cdef int64_t steps = 0
    while p > lo and e[p - 1].ts >= t:
        p -= 1
        steps += 1
        if steps == 8:
            return _lower(e, lo, p, t)
    return p


cdef inline int _sample_row(const Layer* c, int64_t i) noexcept nogil:
    """Fill row ``i`` of layer ``c``; return 1 when its root is out of range or not finite."""
    cdef int64_t k = c.k, o = i * c.k, v = c.dst[i], n = 0, j, start, stop, end, p, avail, row, pos
    cdef double t = c.dst_t[i]
    cdef uint64_t x = 0
    cdef int64_t drawn[MAX_PREFETCH]
    cdef const Entry* e
    cdef bint live = 1
    if c.hint != NULL and i + PREFETCH < c.m and c.valid[i + PREFETCH]:
        # the twin entry a later row starts from: its cache miss overlaps this row's work
        fo_prefetch(&c.edges[c.hint[i + PREFETCH] - 1])
    if c.valid == NULL:
        if v < 0 or v >= c.num_nodes or not (t - t == 0.0):
            live = 0
    else:
        live = c.valid[i]
    if live:
        row = v if c.rows == NULL else c.rows[v]
        start = c.indptr[row]
        stop = c.indptr[row + 1]
        if c.hint != NULL and c.hint[i] >= 0:
            end = _retreat(c.edges, start, c.hint[i], t)
        elif c.ptr != NULL:
            p = c.ptr[row]
            if p > start and c.edges[p - 1].ts >= t:
                end = _lower(c.edges, start, p, t)
            else:
                end = _advance(c.edges, p, stop, t)
                if end > p:
                    c.ptr[row] = end
        else:
            end = _lower(c.edges, start, stop, t)
        avail = end - start
        n = avail if avail < k else k
        if c.uniform and avail > k:
            # draw every slot first and prefetch its entry: the k cache misses of a long row
            # then overlap instead of following one another
            x = _mix(c.key ^ (<uint64_t>i * <uint64_t>0xD1B54A32D192ED03ULL))
            for j in range(n if n <= MAX_PREFETCH else 0):
                pos = <int64_t>((_mix(x + <uint64_t>(j + 1) * <uint64_t>0x9E3779B97F4A7C15ULL) >> 11)
                                * (1.0 / 9007199254740992.0) * avail)
                drawn[j] = start + (pos if pos < avail else avail - 1)
                fo_prefetch(&c.edges[drawn[j]])
        for j in range(n):
            if not c.uniform:
                e = &c.edges[end - 1 - j]
            elif avail <= k:
                e = &c.edges[start + j]
            elif n <= MAX_PREFETCH:
                e = &c.edges[drawn[j]]
            else:
                pos = <int64_t>((_mix(x + <uint64_t>(j + 1) * <uint64_t>0x9E3779B97F4A7C15ULL) >> 11)
                                * (1.0 / 9007199254740992.0) * avail)
                e = &c.edges[start + (pos if pos < avail else avail - 1)]
            c.nbr[o + j] = e.nbr
            c.eid[o + j] = e.eid
            c.nts[o + j] = e.ts
            c.dt[o + j] = <float>(t - e.ts)
            c.mask[o + j] = 1
            if c.next_hint != NULL:
                c.next_hint[o + j] = e.twin
    for j in range(n, k):
        if c.next_hint != NULL:
            c.next_hint[o + j] = -1
        c.nbr[o + j] = 0
        c.eid[o + j] = -1
        c.nts[o + j] = 0.0
        c.dt[o + j] = 0.0
        c.mask[o + j] = 0
    c.out_indptr[i + 1] = n
    return 0 if live or c.valid != NULL else 1


cdef inline int64_t _append(Entry* edges, int64_t* cursor, int64_t row, int64_t nbr, int64_t eid,
                            double ts) noexcept nogil:
    """Append an entry to T-CSR row ``row``; return its index."""
    cdef int64_t at = cursor[row]
    cursor[row] += 1
    edges[at].nbr = nbr
    edges[at].eid = eid
    edges[at].ts = ts
    edges[at].twin = -1
    return at
