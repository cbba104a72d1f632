"""Declarations of the compiled temporal sampler (``fastopt.runtime.sampler``): the T-CSR entry,
the per-layer and dedup work descriptors shared by its nogil loops, and the sampler's C state."""

from libc.stdint cimport int64_t, uint64_t, uint8_t


cdef struct Entry:
    # one T-CSR entry: the neighbor, the edge id, its time, and the index of the same event's
    # entry in the neighbor's row (-1 when directed): where the next layer's candidates end
    int64_t nbr
    int64_t eid
    double ts
    int64_t twin


cdef struct Bitset:
    # two-level bitmap over an id range, with a rank base per level-0 word and the list of
    # level-0 words that became non-zero (what the level-1 bits and the clearing walk)
    uint64_t* bits0
    uint64_t* bits1
    int64_t* base
    int64_t* touched
    int64_t words1
    int64_t ntouched


cdef struct Task:
    # one unique+inverse computation over segments [first, first + nseg)
    int64_t first
    int64_t nseg
    int64_t offset
    int64_t count
    int64_t* values
    Bitset* bits


cdef struct Seg:
    # one id array taking part in a dedup task, and where its inverse goes; a batch-level
    # segment may instead stand for a layer task's distinct ids (source): its inverse is then a
    # remap of those ids, gathered through the layer's inverse into ``out``
    const int64_t* ids
    int64_t* inv
    int64_t n
    const Task* source
    const int64_t* source_inv
    int64_t nsource
    int64_t* out


cdef struct Layer:
    # everything one layer's rows read and write
    const Entry* edges
    const int64_t* indptr
    int64_t* ptr  # per-row time pointer (root layer only, else NULL)
    const int64_t* rows  # node -> T-CSR row (NULL: identity)
    const int64_t* dst
    const double* dst_t
    const uint8_t* valid  # previous layer's mask (NULL for the root layer)
    const int64_t* hint  # twin entry of each row's own edge (NULL for the root layer)
    int64_t* next_hint  # where this layer's twins go for the next layer (NULL for the last)
    int64_t num_nodes
    int64_t m
    int64_t k
    bint uniform
    uint64_t key
    int64_t* nbr
    int64_t* eid
    double* nts
    float* dt
    uint8_t* mask
    int64_t* out_indptr


cdef class TemporalSampler:
    cdef Entry* _edges  # T-CSR entries, row by row, each row in time order
    cdef int64_t* _indptr  # [rows + 1] row starts
    cdef int64_t* _ptr  # [rows] per-row time pointer of the root layer
    cdef int64_t* _rows  # [num_nodes] node -> row under the reordering (NULL: identity)
    cdef int64_t* _fanout
    cdef Bitset* _bitsets  # one per dedup task
    cdef Bitset* _merge_bits  # merged repeats' keys (hop_dedup)
    cdef int* _cpus  # CPU of each thread when pinned (NULL: not pinned)
    cdef int _num_layers
    cdef int _nthreads
    cdef bint _uniform
    cdef int64_t _num_nodes
    cdef int64_t _num_edges
    cdef uint64_t _key
    cdef uint64_t _epoch
    cdef uint64_t _batch
    cdef object _lock
    cdef object _row_map
    cdef readonly list fanouts
    cdef readonly str strategy
    cdef readonly int threads
    cdef readonly uint64_t seed
    cdef readonly bint undirected
    cdef readonly str reorder
    cdef readonly bint pin_threads
    cdef readonly bint dedup
    cdef readonly bint hop_dedup
    cdef object _high_water
    cdef readonly object placement

    cdef int _num_tasks(self)
    cdef bint _is_node_task(self, int i)
    cdef tuple _merge(self, block, next_hint, str kind)
    cdef _pin(self, roots)
    cdef _unpin(self, int nth)
    cdef _sample(self, roots, times, uint64_t counter)
    cdef tuple _plan_dedup(self, roots, list blocks, Task* tasks, Seg* segs)
    cdef _attach_dedup(self, batch, Task* tasks, tuple outputs)
