# Included by sampler.pyx: within-batch dedup with a two-level bitmap and popcount ranks
# (sorted unique ids and inverse indices in O(entries + id range / 4096), no sort).

cdef void _bitset_init(Bitset* b, int64_t id_range) noexcept nogil:
    cdef int64_t words0 = (id_range + 63) // 64 + 1
    b.words1 = (words0 + 63) // 64
    b.bits0 = <uint64_t*>calloc(words0, sizeof(uint64_t))
    b.bits1 = <uint64_t*>calloc(b.words1, sizeof(uint64_t))
    b.base = <int64_t*>malloc(words0 * sizeof(int64_t))
    b.touched = <int64_t*>malloc(words0 * sizeof(int64_t))


cdef void _bitset_free(Bitset* b) noexcept nogil:
    free(b.bits0)
    free(b.bits1)
    free(b.base)
    free(b.touched)


cdef void _mark(Task* t, const Seg* segs) noexcept nogil:
    """Set the bit of every id of the task's segments; count the distinct ids.

    The loop has no branch and one read-modify-write: a word that turns non-zero is appended to
    the touched list (written always, kept when it was zero), whose words set the level-1 bits.
    """
    cdef uint64_t* bits0 = t.bits.bits0
    cdef int64_t* touched = t.bits.touched
    cdef int64_t s, i, x, w, nt = 0, count = 0
    cdef uint64_t old
    cdef const int64_t* ids
    for s in range(t.first, t.first + t.nseg):
        ids = segs[s].ids
        for i in range(segs[s].n):
            x = ids[i] + t.offset
            w = x >> 6
            old = bits0[w]
            bits0[w] = old | ((<uint64_t>1) << (x & 63))
            touched[nt] = w
            nt += old == 0
    for i in range(nt):
        w = touched[i]
        t.bits.bits1[w >> 6] |= (<uint64_t>1) << (w & 63)
        count += fo_popcount(bits0[w])
    t.bits.ntouched = nt
    t.count = count


cdef void _rank(Task* t, const Seg* segs) noexcept nogil:
    """Write the sorted unique ids and each entry's rank among them; clear the bitmap."""
    cdef uint64_t* bits0 = t.bits.bits0
    cdef uint64_t* bits1 = t.bits.bits1
    cdef int64_t* base = t.bits.base
    cdef int64_t s, i, w, w1, u = 0
    cdef uint64_t m1, m0
    for w1 in range(t.bits.words1):
        m1 = bits1[w1]
        while m1:
            w = (w1 << 6) | fo_ctz(m1)
            m1 &= m1 - 1
            base[w] = u
            m0 = bits0[w]
            while m0:
                t.values[u] = ((w << 6) | fo_ctz(m0)) - t.offset
                u += 1
                m0 &= m0 - 1
    for s in range(t.first, t.first + t.nseg):
        fo_rank_ids(segs[s].ids, segs[s].n, t.offset, bits0, base, segs[s].inv)
    for i in range(t.bits.ntouched):
        w = t.bits.touched[i]
        bits0[w] = 0
        bits1[w >> 6] = 0


cdef void _dedup_task(Task* t, Seg* segs) noexcept nogil:
    """Unique ids and inverse of one task (a layer task's results must be complete if it is a
    source of this one)."""
    cdef int64_t s, i
    cdef Seg* g
    for s in range(t.first, t.first + t.nseg):
        g = &segs[s]
        if g.source != NULL:
            g.ids = g.source.values
            g.n = g.source.count
    _mark(t, segs)
    _rank(t, segs)
    for s in range(t.first, t.first + t.nseg):
        g = &segs[s]
        if g.source != NULL:
            for i in range(g.nsource):
                g.out[i] = g.inv[g.source_inv[i]]
