# Included by sampler.pyx: the inline C it needs (pinning a thread to a CPU and undoing it; ctz, prefetch and
# popcount builtins; the popcount rank loop of the dedup, with a popcnt build picked at run time).

cdef extern from *:
    """
    #if defined(__linux__)
    #include <sched.h>
    static __thread int fo_pinned_cpu = -1;
    static cpu_set_t fo_home_set;  /* the CPUs the process may use, read at import */
    static int fo_home_known = 0;
    /* the largest loop team this thread started that pinned its threads (0: none since the last
       unpinning): OpenMP keeps a calling thread's team for its later loops */
    static __thread int fo_team_pinned = 0;
    static void fo_read_home(void) {
        fo_home_known = sched_getaffinity(0, sizeof(fo_home_set), &fo_home_set) == 0;
    }
    /* Pin the calling thread to one CPU; a thread already pinned there makes no system call. */
    static int fo_pin_self(int cpu) {
        cpu_set_t set;
        if (fo_pinned_cpu == cpu) return 0;
        if (!fo_home_known) return -1;  /* could not be undone */
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) return -1;
        fo_pinned_cpu = cpu;
        return 0;
    }
    /* Give a thread this module pinned back every CPU of the process; others make no call. */
    static int fo_unpin_self(void) {
        if (fo_pinned_cpu < 0) return 0;
        if (sched_setaffinity(0, sizeof(fo_home_set), &fo_home_set) != 0) return -1;
        fo_pinned_cpu = -1;
        return 0;
    }
    #else
    static void fo_read_home(void) {}
    static int fo_pin_self(int cpu) { (void)cpu; return -1; }
    static int fo_unpin_self(void) { return 0; }
    static __thread int fo_team_pinned = 0;
    #endif
    #include <stdint.h>
    #define fo_ctz(x) __builtin_ctzll(x)
    #define fo_prefetch(p) __builtin_prefetch(p)
    #define fo_popcount(x) __builtin_popcountll(x)
    /* inv[i] = rank of ids[i] + off among the set bits: the base of its word plus the set bits
       below it. x86-64 builds without -mpopcnt would call a slow libgcc routine for the popcount,
       so the loop is compiled twice and the popcnt version picked when the CPU has it. */
    #define FO_RANK_LOOP                                                            \
        for (int64_t i = 0; i < n; i++) {                                           \
            int64_t x = ids[i] + off, w = x >> 6;                                   \
            inv[i] = base[w] + __builtin_popcountll(bits0[w] & ((1ULL << (x & 63)) - 1)); \
        }
    #define FO_RANK_ARGS const int64_t* ids, int64_t n, int64_t off, const uint64_t* bits0, \
                         const int64_t* base, int64_t* inv
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__POPCNT__)
    __attribute__((target("popcnt"))) static void fo_rank_hw(FO_RANK_ARGS) { FO_RANK_LOOP }
    static void fo_rank_sw(FO_RANK_ARGS) { FO_RANK_LOOP }
    static void fo_rank_ids(FO_RANK_ARGS) {
        if (__builtin_cpu_supports("popcnt")) fo_rank_hw(ids, n, off, bits0, base, inv);
        else fo_rank_sw(ids, n, off, bits0, base, inv);
    }
    #else
    static void fo_rank_ids(FO_RANK_ARGS) { FO_RANK_LOOP }
    #endif
    """
    void fo_read_home() noexcept nogil
    int fo_pin_self(int cpu) noexcept nogil
    int fo_unpin_self() noexcept nogil
    int fo_team_pinned
    int fo_popcount(uint64_t x) noexcept nogil
    int fo_ctz(uint64_t x) noexcept nogil
    void fo_prefetch(const void* p) noexcept nogil
    void fo_rank_ids(const int64_t* ids, int64_t n, int64_t off, const uint64_t* bits0,
                     const int64_t* base, int64_t* inv) noexcept nogil


fo_read_home()  # the process's CPUs, which a pinned thread gets back
