# Included by sampler.pyx: the inline C it needs (pinning a thread to a CPU; ctz, prefetch and
# popcount builtins; the popcount rank loop of the dedup, with a popcnt build picked at run time).

cdef extern from *:
    """
    #if defined(__linux__)
    #include <sched.h>
    static __thread int fo_pinned_cpu = -1;
    /* Pin the calling thread to one CPU; a thread already pinned there makes no system call. */
    static int fo_pin_self(int cpu) {
        cpu_set_t set;
        if (fo_pinned_cpu == cpu) return 0;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) return -1;
        fo_pinned_cpu = cpu;
        return 0;
    }
    #else
    static int fo_pin_self(int cpu) { (void)cpu; return -1; }
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
    int fo_pin_self(int cpu) noexcept nogil
    int fo_popcount(uint64_t x) noexcept nogil
    int fo_ctz(uint64_t x) noexcept nogil
    void fo_prefetch(const void* p) noexcept nogil
    void fo_rank_ids(const int64_t* ids, int64_t n, int64_t off, const uint64_t* bits0,
                     const int64_t* base, int64_t* inv) noexcept nogil
