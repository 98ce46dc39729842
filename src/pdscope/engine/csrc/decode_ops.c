/* Decode-step kernels for pdscope's engine on CPU, in plain C (no torch headers: it builds in
 * about a second with the gcc a fresh machine has). engine/native.py compiles it on first use,
 * loads it with ctypes and keeps the pure-PyTorch path as the reference and the fallback.
 *
 * Every tensor is passed as a data pointer to contiguous memory in the layout the engine uses:
 *   kv cache   [2, kv_heads, slots, dim]   (K plane, V plane; slot = block * block_size + i)
 *   qkv        [tokens, (heads + 2 * kv_heads) * dim]   (the fused projection's output)
 *   rope cos/sin tables   float32 [positions, dim], laid out as engine/model.py's apply_rope
 *                         takes them: cos = [c, c], sin = [-s, s]
 * `bf` says the model dtype: 1 = bfloat16, 0 = float32. Math is float32 throughout; a bf16
 * result is rounded to nearest even once, where PyTorch's op-by-op path rounds after each op.
 * `threads` is torch's intra-op thread count: the library links the same libgomp as torch, so
 * both share one OpenMP thread pool.
 */
#define _GNU_SOURCE /* sched_setaffinity */
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef uint16_t bf16;

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- A decode step's team. decode_layers and decode_logits run a whole step inside one
 * OpenMP region: every thread calls each kernel in turn, takes its share of the kernel's work
 * and waits for the others at a barrier of our own, which spins at least as long as libgomp is
 * told to and then sleeps on a futex. Each kernel opening its own region, as it does when called
 * alone, cost a step ~110 fork-joins, and where libgomp's workers sleep soon after a region
 * ends (GOMP_SPINCOUNT=1000, what `pdscope serve` set so that idle workers leave the cores
 * to the HTTP loop between steps; 10,000 now but for small models) each one paid a wake-up.
 * Inside a step the threads now spin, and sleep only after a long wait; between steps
 * libgomp's own policy still sends them to sleep. Fields that different threads write sit on
 * cache lines apart. */
typedef struct {
    _Alignas(64) int arrived;    /* the barrier (GCC __atomic builtins) */
    _Alignas(64) int generation; /* a futex word too */
    int sleepers;                /* threads in futex_wait on generation or released */
    int spins;                   /* pauses before a waiter sleeps */
    _Alignas(64) int released;   /* serial kernels thread 0 has finished (a futex word) */
    _Alignas(64) int64_t ticket; /* dynamic work items handed out this step */
    int failed;                  /* a thread could not allocate its scratch memory */
    float *att_parts; /* paged_decode_attention's parts, sized by decode_layers_scratch */
} team_state;

typedef struct {
    int id, n;
    team_state *state;
    int64_t ticket_base; /* the first ticket of the next dynamic loop: the same on every thread */
    int serial;          /* serial kernels this thread has passed */
} team_member;

static __thread team_member *step_member; /* set while this thread runs in a step's team */

/* Waits until *word >= target: spins, then sleeps on the futex word (see team_wake). */
static void team_wait(team_state *t, int *word, int target) {
    for (int spins = 0;; spins++) {
        const int now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (now >= target) return;
        if (spins < t->spins) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            continue;
        }
        __atomic_add_fetch(&t->sleepers, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, now, NULL, NULL, 0);
        __atomic_sub_fetch(&t->sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

/* *word = value, waking its sleepers. seq_cst both here and at a sleeper's count: either
 * this sees the sleeper, or the sleeper's futex_wait sees the new value and returns. */
static void team_wake(team_state *t, int *word, int value) {
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&t->sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Every thread of the team waits here for the rest. A step's waits are short (one kernel's
 * imbalance), so they spin; a long one means another thread is off its CPU (more threads
 * than CPUs, or a busy host), so the waiter sleeps, leaving it this CPU. */
static void team_barrier(const team_member *m) {
    if (m->n == 1) return;
    team_state *t = m->state;
    const int gen = __atomic_load_n(&t->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&t->arrived, 1, __ATOMIC_ACQ_REL) == m->n) {
        __atomic_store_n(&t->arrived, 0, __ATOMIC_RELAXED);
        team_wake(t, &t->generation, gen + 1);
        return;
    }
    team_wait(t, &t->generation, gen + 1);
}

/* The end of a kernel thread 0 ran alone: it goes straight on, and the others wait until it
 * is done, for the next kernel reads what it wrote. Thread 0 never waits for threads with
 * nothing to do, so a kernel too small to split needs no other thread on a CPU, as it did
 * when run outside the team. */
static void team_serial_done(team_member *m) {
    if (m->n == 1) return;
    m->serial++;
    if (m->id == 0) team_wake(m->state, &m->state->released, m->serial);
    else team_wait(m->state, &m->state->released, m->serial);
}

/* This thread's share [lo, hi) of n items, split evenly in order over its team: the step's
 * (all on thread 0 when the kernel runs serially, `parallel` 0), or else the OpenMP region's
 * it runs in (all of them outside one). */
static inline void thread_share(int64_t n, int64_t *lo, int64_t *hi) {
    *lo = 0, *hi = n;
    const team_member *m = step_member;
    if (m) {
        *lo = n * m->id / m->n;
        *hi = n * (m->id + 1) / m->n;
        return;
    }
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), team = omp_get_num_threads();
    *lo = n * id / team;
    *hi = n * (id + 1) / team;
#endif
}

/* CALL (which reads lo and hi) over this thread's share of n items. Inside a step's team every
 * thread runs its share, then waits for the rest; a serial kernel (`parallel` 0) runs on
 * thread 0 alone. Called alone the kernel opens its own region, one thread when serial. A
 * share's items are computed independently, so the bits do not depend on the split. */
#define FOR_SHARE(n, parallel, threads, CALL) \
    do { \
        team_member *m_ = step_member; \
        const int par_ = (parallel), threads_ = (threads); \
        (void)threads_; \
        if (m_) { \
            if (par_ || m_->id == 0) { \
                int64_t lo, hi; \
                if (par_) thread_share((n), &lo, &hi); \
                else lo = 0, hi = (n); \
                CALL; \
            } \
            if (par_) team_barrier(m_); \
            else team_serial_done(m_); \
        } else { \
            _Pragma("omp parallel num_threads(threads_) if (par_)") \
            { \
                int64_t lo, hi; \
                thread_share((n), &lo, &hi); \
                CALL; \
            } \
        } \
    } while (0)

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_DPBF16 1 /* vdpbf16ps: pairs of bf16 products summed into float32 */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_BF16 1 /* AVX2 and FMA, no AVX-512 BF16: bf16 widened to float32 for FMAs */

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* KEEP_LOOP() in each loop of _mm_prefetch: gcc 12 (-O1 and up) may delete prefetches as code
 * without side effects. The jump prefetch's fixed 32-iteration loop (below) was not in the
 * engine's library from the commit that wrote it until the fourteenth session (objdump -d |
 * grep prefetch), while the K-row loop's variable count kept it. An empty volatile asm is a
 * side effect gcc keeps, and it leaves the prefetches free to be scheduled: prefetches written
 * as inline asm made the attention loop 1.16-1.21x slower. */
#define KEEP_LOOP() __asm__ volatile("")

static inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline void load_f32(const void *base, int64_t offset, int64_t n, float *dst, int bf) {
    if (bf) {
        const bf16 *src = (const bf16 *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

static inline void store_f32(void *base, int64_t offset, int64_t n, const float *src, int bf) {
    if (bf) {
        bf16 *dst = (bf16 *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    }
}

/* exp's range reduction and polynomial, the same at every vector width below: x = n ln 2 + r
 * (ln 2 in two parts, so r keeps its low bits), exp(r) by its Taylor terms to r^6 as FMA
 * steps. FMA(a, b, c) is a * b + c, FNMA(a, b, c) is c - a * b, SET(v) a constant vector. */
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187e-06f
#define EXP_REDUCE(FNMA, SET, n, x) FNMA(n, SET(EXP_LN2_LO), FNMA(n, SET(EXP_LN2_HI), x))
#define EXP_TERMS(FMA, SET, r)                                                                  \
    FMA(FMA(FMA(FMA(FMA(FMA(SET(1.0f / 720), r, SET(1.0f / 120)), r, SET(1.0f / 24)), r,      \
                    SET(1.0f / 6)),                                                             \
                r, SET(0.5f)),                                                                  \
            r, SET(1.0f)),                                                                      \
        r, SET(1.0f))

/* exp(x) for -87 <= x <= 0: 2^n * p(r), |r| <= ln2 / 2, a degree-6 polynomial (relative
 * error ~2e-7); libm's expf stays scalar without -ffast-math. */
static inline float exp_poly(float x) {
    float t = x * 1.44269504088896341f;
    int32_t n = (int32_t)(t - 0.5f); /* round to nearest for t <= 0 */
    float r = x - (float)n * EXP_LN2_HI - (float)n * EXP_LN2_LO;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp(-|x|), the clamp at 87 taken on the bits: non-negative floats order as their bit
 * patterns do, so an integer min is exact, and gcc vectorizes a loop around it (it treats the
 * float select above as control flow, and fmaxf is a libm call without -ffast-math). */
static inline float exp_neg_abs(float x) {
    float a = fabsf(x);
    uint32_t bits;
    memcpy(&bits, &a, sizeof bits);
    bits = bits < 0x42AE0000u ? bits : 0x42AE0000u; /* 87.0f */
    memcpy(&a, &bits, sizeof a);
    return exp_poly(-a);
}

/* exp(x) for x <= 0 (softmax after subtracting the max), which is exp(-|x|): inputs below
 * -87 (and -inf) flush to ~1e-38, i.e. nothing. */
static inline float exp_nonpositive(float x) { return exp_neg_abs(x); }

/* Keys scored per tile: consecutive slots (one cache block, or several adjacent ones). */
#ifndef NEW_DECODE_ATTENTION
/* 2: the scores on AMX tiles where granted; 1: AVX-512 only (the A/B of
 * bench/decode_attention_ab.py); 0: the generic loop only (bench/decode_ops_ab.py) */
#define NEW_DECODE_ATTENTION 2
#endif
/* The tile of keys from pos: returns its first slot and sets *n to how many keys (up to
 * `most`, never past hi) follow it in consecutive slots, whole blocks joined where the table's
 * next block lies right after the last. Every decode attention walks its table this way. */
static inline __attribute__((always_inline)) int64_t tile_at(const int64_t *table,
                                                             int64_t block_size, int64_t pos,
                                                             int64_t hi, int64_t most,
                                                             int64_t *n) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    int64_t k = block_size - pos % block_size;
    while (k < most && pos + k < hi && table[(pos + k) / block_size] * block_size == slot + k)
        k += block_size;
    if (k > most) k = most;
    if (k > hi - pos) k = hi - pos;
    *n = k;
    return slot;
}

#define TILE 64

/* Partial attention of one query group over key positions [lo, hi) of one sequence:
 * running max m[g], sum l[g] and unnormalized output acc[g][dim] (flash-decoding style). */
static inline __attribute__((always_inline)) void attend_range_impl(
                         const float *qf, int64_t group, const int64_t dim, const void *kv,
                         int64_t kv_heads, int64_t slots, int64_t head, const int64_t *table,
                         int64_t block_size, int64_t lo, int64_t hi, int bf, float *m, float *l,
                         float *acc, const bf16 *qb, float scale) {
    float row[dim], s[group * TILE];
#ifdef HAVE_DPBF16
    /* qb (bf16, dim 64, group <= 8): the scores straight from the cache's bf16 rows with
     * vdpbf16ps, no conversion of K to float32; the products are exact in float32. */
    __m512bh qv[8][2];
    if (qb)
        for (int64_t g = 0; g < group; g++)
            for (int c = 0; c < 2; c++)
                qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * 64 + c * 32));
#else
    (void)qb;
    (void)scale;
#endif
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int64_t i = 0; i < dim; i++) acc[g * dim + i] = 0.0f;
    }
    const int64_t k_plane = head * slots, v_plane = (kv_heads + head) * slots;
    for (int64_t pos = lo; pos < hi;) {
        int64_t n;
        const int64_t slot = tile_at(table, block_size, pos, hi, TILE, &n);
#ifdef HAVE_DPBF16
        if (qb) {
            for (int64_t t = 0; t < n; t++) {
                const bf16 *kr = (const bf16 *)kv + (k_plane + slot + t) * 64;
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)kr);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void *)(kr + 32));
                for (int64_t g = 0; g < group; g++) {
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0);
                    a = _mm512_dpbf16_ps(a, qv[g][1], k1);
                    s[g * TILE + t] = _mm512_reduce_add_ps(a) * scale;
                }
            }
        } else
#endif
        for (int64_t t = 0; t < n; t++) {
            load_f32(kv, (k_plane + slot + t) * dim, dim, row, bf);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qf + g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < dim; i++) dot += qg[i] * row[i];
                s[g * TILE + t] = dot;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *sg = s + g * TILE, *ag = acc + g * dim;
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
            float alpha = exp_nonpositive(m[g] - mx), sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                sg[t] = exp_nonpositive(sg[t] - mx);
                sum += sg[t];
            }
            l[g] = l[g] * alpha + sum;
            m[g] = mx;
            for (int64_t i = 0; i < dim; i++) ag[i] *= alpha;
        }
        for (int64_t t = 0; t < n; t++) {
            load_f32(kv, (v_plane + slot + t) * dim, dim, row, bf);
            for (int64_t g = 0; g < group; g++) {
                const float p = s[g * TILE + t];
                float *ag = acc + g * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) ag[i] += p * row[i];
            }
        }
        pos += n;
    }
}

#ifdef HAVE_DPBF16
/* ---- Decode attention for bf16 caches with head size 64 and up to 4 query heads per KV head,
 * written with AVX-512 intrinsics: at long context the generic loop above runs at ~2.5 GB/s of
 * KV on one core (its accumulators live in memory, and each score ends in a horizontal sum).
 * Here 16 keys go at a time: their scores are `vdpbf16ps` partial sums reduced 16 at once by a
 * transpose-and-add tree, the softmax's exp is vectorized (scalef applies the 2^n), and the
 * unnormalized output of every query head stays in registers. V is summed by `vdpbf16ps` over
 * pairs of keys with the softmax weights rounded to bf16 (bf16_weights), half the operations of
 * widening V to float32 for FMAs. Same contract as attend_range: m, l, acc for keys [lo, hi). */

/* out[t] = sum of the 16 lanes of v[t], t < 16. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int t = 0; t < 8; t++)
        w[t] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * t], v[2 * t + 1]),
                             _mm512_unpackhi_ps(v[2 * t], v[2 * t + 1]));
    for (int j = 0; j < 4; j++)
        x[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0xEE));
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                     _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                     _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                         _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

/* exp(x) for x <= 0, 16 lanes; below -87 it is ~1e-38 (callers zero the lanes they mask). */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = EXP_REDUCE(_mm512_fnmadd_ps, _mm512_set1_ps, n, x);
    return _mm512_scalef_ps(EXP_TERMS(_mm512_fmadd_ps, _mm512_set1_ps, r), n);
}

/* Elements 2k and 2k + 1 of x (a bf16 pair in 32 bits) in every lane, for vdpbf16ps. */
static inline __m512bh pair_of(const bf16 *x, int64_t k) {
    uint32_t v;
    memcpy(&v, x + 2 * k, sizeof v);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* 16 bf16 values (32 bytes) to float32. */
static inline __m512 bf16x16_to_f32(const bf16 *src) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}


/* 16 K rows and 16 V rows of 64 bf16 into L2 (prefetch_rows16_l2) or L1 (_l1, for
 * decode_prefetch=every, below); the hint must be a constant, hence one body for both. Out of
 * line: inlined into the attention loops, the 64 prefetches made the loop 1.24-1.37x slower at
 * one thread even where none ran (contiguous tables). */
#define PREFETCH_ROWS16(NAME, HINT)                                                    \
    __attribute__((noinline)) static void NAME(const bf16 *k, const bf16 *v) {         \
        for (int i = 0; i < 16 * 64; i += 32) {                                        \
            _mm_prefetch((const char *)(k + i), HINT);                                 \
            _mm_prefetch((const char *)(v + i), HINT);                                 \
            KEEP_LOOP();                                                               \
        }                                                                              \
    }
PREFETCH_ROWS16(prefetch_rows16_l2, _MM_HINT_T1)
PREFETCH_ROWS16(prefetch_rows16_l1, _MM_HINT_T0)
#undef PREFETCH_ROWS16

/* The kernel choice's decode_prefetch (engine/kernels.py), set by set_decode_prefetch: one
 * setting for the process, as the library is loaded once. 0 (jumps): only where the table
 * jumps, below; 1 (every): the 16 keys after the next tile, run or jump, into L1. Which is
 * faster differs by CPU, so the engine times both at load. On the Intel Xeon with AMX, 12
 * layers at 4,000 keys and 2 threads took 0.77x the time with every
 * (bench/decode_attention_ab.py --ab-source); on the AMD EPYC (Zen 4), prefetching runs cost a
 * quarter of the read rate. */
static int prefetch_every = 0;

/* Returns 1 where this build's decode attention (AVX-512 BF16, head size 64 with 1-4 query
 * heads a KV head, 128 with 1-8) takes the setting: not in a build of the generic loop only
 * (the benches'). */
int set_decode_prefetch(int every) {
    prefetch_every = every != 0;
    return NEW_DECODE_ATTENTION != 0;
}

int decode_prefetch_every(void) { return prefetch_every; }

/* The K and V rows of the 16 keys after the next tile into L2, where they do not continue this
 * tile's run (decode_prefetch=jumps): a block's rows are contiguous but blocks need not be, and
 * the hardware prefetcher cannot see a jump to another block. Where they continue it, the
 * hardware prefetcher follows them on an AMD EPYC (Zen 4), where prefetching them anyway cost a
 * quarter of the read rate. Shuffled or descending tables of 16-key blocks (bench/
 * decode_ops_ab.py --block-order's queue order) are read at less than half the rate of
 * ascending ones; with this, at ~0.7-0.75x the time they took without it, at 4,000 keys and
 * 2 threads. To L1 instead (prefetcht0) it did nothing measurable there; in a plain reader of
 * the same pattern too. Either way the 16 rows from `next` are that tile's keys where blocks
 * hold 16 or more (the engine's 16); with smaller blocks the rows past the block are another
 * block's, or past the cache's end for its last block: a prefetch never faults. */
/* Here for rows of `dim` bf16 (a multiple of 64): dim / 64 calls of the 16-row prefetchers a
 * plane. prefetch_tile_after_next below is head size 64's. */
static inline __attribute__((always_inline)) void prefetch_tile_after_next_of(
    const int64_t dim, const bf16 *kp, const bf16 *vp, const int64_t *table, int64_t block_size,
    int64_t pos, int64_t n, int64_t hi, int64_t slot) {
    const int64_t ahead = pos + n + 16;
    if (ahead >= hi) return;
    const int64_t next = table[ahead / block_size] * block_size + ahead % block_size;
    const int every = prefetch_every;
    if (!every && next == slot + (ahead - pos)) return;
    for (int64_t off = next * dim; off < (next + 16) * dim; off += 16 * 64) {
        if (every)
            prefetch_rows16_l1(kp + off, vp + off);
        else
            prefetch_rows16_l2(kp + off, vp + off);
    }
}

static inline void prefetch_tile_after_next(const bf16 *kp, const bf16 *vp, const int64_t *table,
                                            int64_t block_size, int64_t pos, int64_t n,
                                            int64_t hi, int64_t slot) {
    prefetch_tile_after_next_of(64, kp, vp, table, block_size, pos, n, hi, slot);
}

/* Two V rows of 64 bf16 (keys t and t + 1: va and vb) interleaved for vdpbf16ps over the
 * pair: v[0] = unpacklo_epi16 of dims 0-31, v[1] unpackhi, v[2] and v[3] the same of 32-63.
 * Without `both` (an odd tile's last key) the second row is zeros: the slot after it may hold
 * anything, and 0 times a NaN left there is a NaN. */
static inline __attribute__((always_inline)) void v_pair_rows(const bf16 *va, const bf16 *vb,
                                                              int both, __m512bh v[4]) {
    const __m512i a0 = _mm512_loadu_si512((const void *)va);
    const __m512i a1 = _mm512_loadu_si512((const void *)(va + 32));
    const __m512i b0 = both ? _mm512_loadu_si512((const void *)vb) : _mm512_setzero_si512();
    const __m512i b1 = both ? _mm512_loadu_si512((const void *)(vb + 32)) : _mm512_setzero_si512();
    v[0] = (__m512bh)_mm512_unpacklo_epi16(a0, b0);
    v[1] = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
    v[2] = (__m512bh)_mm512_unpacklo_epi16(a1, b1);
    v[3] = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
}

/* The same of two adjacent rows of 64 (head size 64). */
static inline __attribute__((always_inline)) void v_pair(const bf16 *va, int both, __m512bh v[4]) {
    v_pair_rows(va, va + 64, both, v);
}

/* 16 float softmax weights rounded to bf16, stored as 8 pairs. The rounding is the one torch's
 * flash attention on CPU and this file's prefill attention make before P @ V: it adds ~20-40% to
 * the output's mean error against float64 over the output's own bf16 rounding, which leaves it
 * at or below torch's SDPA on the same inputs. Keeping the rest as a second bf16 part (hi + lo,
 * as close as a float sum) took a third more time a key: 8 more vdpbf16ps of the 24. */
static inline void bf16_weights(__m512 e, uint32_t w[8]) {
    _mm256_storeu_si256((__m256i *)w, (__m256i)_mm512_cvtneps_pbh(e));
}

/* o[c] += the pair's weights (a bf16 pair packed in 32 bits) times v[c]. */
static inline __attribute__((always_inline)) void add_v_pair(__m512 o[4], const __m512bh v[4],
                                                             uint32_t w) {
    const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
    for (int c = 0; c < 4; c++) o[c] = _mm512_dpbf16_ps(o[c], pw, v[c]);
}

/* One head's 4 accumulators of v_pair sums to dims 0-63: unpacklo/hi_epi16 pair the rows within
 * each 128-bit lane, so lane j of o[0] holds dim 8 (j / 4) + j % 4 and o[1] that + 4; o[2] and
 * o[3] the same + 32. */
static inline void store_v_pair_sums(const __m512 o[4], float *acc) {
    float lanes[4][16];
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(lanes[c], o[c]);
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 16; j++) acc[(c / 2) * 32 + 8 * (j / 4) + (c % 2) * 4 + j % 4] = lanes[c][j];
}

/* One head's softmax step over a tile: its 16 scaled scores s (lanes past the tile's keys left
 * out by `valid`) against the running max *mx and lane sums *sum; the weights into pw, rounded
 * to bf16. Returns the factor the head's earlier output sums must be scaled by, or 1 where the
 * max did not grow: after the first keys that is most tiles, which skip the scalar exp and its
 * latency (a first max gives 0: there is nothing to keep). */
static inline __attribute__((always_inline)) float head_tile_softmax(__m512 s, __mmask16 valid,
                                                                     float *mx, __m512 *sum,
                                                                     uint32_t pw[8]) {
    const float smax = _mm512_mask_reduce_max_ps(valid, s);
    float alpha = 1.0f;
    if (smax > *mx) {
        alpha = *mx == -INFINITY ? 0.0f : exp_nonpositive(*mx - smax);
        *sum = _mm512_mul_ps(*sum, _mm512_set1_ps(alpha));
        *mx = smax;
    }
    const __m512 e =
        _mm512_maskz_mov_ps(valid, exp16_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(*mx))));
    *sum = _mm512_add_ps(*sum, e);
    bf16_weights(e, pw);
    return alpha;
}

static inline __attribute__((always_inline)) void attend_bf16_d64_impl(
    const int G, const bf16 *qb, const void *kv, int64_t kv_heads, int64_t slots, int64_t head,
    const int64_t *table, int64_t block_size, int64_t lo, int64_t hi, float *m, float *l,
    float *acc, float scale) {
    __m512bh qv[4][2];
    __m512 o[4][4], sum[4]; /* sum: the softmax denominator, per lane until the end */
    float mx[4];
    for (int g = 0; g < G; g++) {
        qv[g][0] = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * 64));
        qv[g][1] = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * 64 + 32));
        for (int c = 0; c < 4; c++) o[g][c] = _mm512_setzero_ps();
        mx[g] = -INFINITY;
        sum[g] = _mm512_setzero_ps();
    }
    const bf16 *kp = (const bf16 *)kv + head * slots * 64;
    const bf16 *vp = (const bf16 *)kv + (kv_heads + head) * slots * 64;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t pos = lo; pos < hi;) {
        int64_t n;
        const int64_t slot = tile_at(table, block_size, pos, hi, 16, &n);
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        prefetch_tile_after_next(kp, vp, table, block_size, pos, n, hi, slot);
        uint32_t pw[4][8]; /* pw[g][h]: head g's weights of keys 2h and 2h + 1 */
        for (int g = 0; g < G; g++) {
            __m512 part[16];
            for (int t = 0; t < 16; t++) {
                if (t < n) {
                    const bf16 *kr = kp + (slot + t) * 64;
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)kr);
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void *)(kr + 32));
                    part[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0),
                                               qv[g][1], k1);
                } else {
                    part[t] = _mm512_setzero_ps();
                }
            }
            const __m512 s = _mm512_mul_ps(sum16(part), vscale);
            const float alpha = head_tile_softmax(s, valid, &mx[g], &sum[g], pw[g]);
            if (alpha != 1.0f) { /* a new running max: rescale what was summed so far */
                const __m512 va = _mm512_set1_ps(alpha);
                for (int c = 0; c < 4; c++) o[g][c] = _mm512_mul_ps(o[g][c], va);
            }
        }
        for (int64_t t = 0; t < n; t += 2) {
            __m512bh v[4];
            v_pair(vp + (slot + t) * 64, t + 1 < n, v);
            for (int g = 0; g < G; g++) {
                add_v_pair(o[g], v, pw[g][t / 2]);
            }
        }
        pos += n;
    }
    for (int g = 0; g < G; g++) {
        m[g] = mx[g];
        l[g] = _mm512_reduce_add_ps(sum[g]);
        store_v_pair_sums(o[g], acc + g * 64);
    }
}


/* Four query heads over one KV head, the heads side by side in each vector instead of a vector
 * per head: lane 4g + j holds head g's j-th partial sum, so one score reduction, one max and one
 * exp serve all four heads.
 *   scores: per key, 8 vdpbf16ps of q's dims 8c..8c+7 of every head (a register each) with the
 *           key's same 8 dims broadcast to the four 128-bit lanes; a 2-step shuffle-add tree
 *           turns the 16 keys' vectors into 4, lane 4g + i holding key 4k + i's score for head g.
 *   values: as the per-head kernel, over pairs of keys (v_pair, add_v_pair).
 * With the cache in L2 on an AMD EPYC (Zen 4) it takes ~10 ns a key where the per-head kernel
 * took ~15: there the per-head kernel was bound by its operations, not by memory. Same contract
 * as attend_range. */
static void attend_bf16_d64_g4(const bf16 *qb, const void *kv, int64_t kv_heads, int64_t slots,
                               int64_t head, const int64_t *table, int64_t block_size, int64_t lo,
                               int64_t hi, float *m, float *l, float *acc, float scale) {
    __m512bh qc[8];
    for (int c = 0; c < 8; c++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(qb + 8 * c)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(qb + 64 + 8 * c)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(qb + 128 + 8 * c)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(qb + 192 + 8 * c)), 3);
        qc[c] = (__m512bh)v;
    }
    __m512 o[4][4];
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++) o[g][c] = _mm512_setzero_ps();
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    const __m512 vscale = _mm512_set1_ps(scale);
    const bf16 *kp = (const bf16 *)kv + head * slots * 64;
    const bf16 *vp = (const bf16 *)kv + (kv_heads + head) * slots * 64;
    for (int64_t pos = lo; pos < hi;) {
        int64_t n;
        const int64_t slot = tile_at(table, block_size, pos, hi, 16, &n);
        prefetch_tile_after_next(kp, vp, table, block_size, pos, n, hi, slot);
        /* This tile's K rows, asked for in address order before the scores read them 16 bytes
         * of each row at a time (one 8-dim slice of 16 rows, then the next): in that order the
         * hardware prefetcher saw a stride, not a stream, and a short run of keys (a batch of
         * sequences of ~150 tokens each) waited on memory for most of its time. On an AMD EPYC
         * (Zen 4): batch 32 x 144 keys 0.78x the time at 1 thread, 0.85x at 2; one sequence of
         * 4,000 keys 0.87-0.89x (/tmp A/B of builds, 12 layers' caches evicted between steps).
         * The next tile's rows instead cost 1.13-1.29x. */
        for (int64_t i = 0; i < n * 64; i += 32) {
            _mm_prefetch((const char *)(kp + slot * 64 + i), _MM_HINT_T0);
            KEEP_LOOP();
        }
        /* the 16 keys' sums advance together, one 8-dim slice at a time, so no key's chain of
         * 8 dependent vdpbf16ps waits on its own latency; keys past n read key 0 (masked) */
        const bf16 *kr[16];
        for (int t = 0; t < 16; t++) kr[t] = kp + (slot + (t < n ? t : 0)) * 64;
        __m512 part[16];
        for (int t = 0; t < 16; t++) part[t] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++)
            for (int t = 0; t < 16; t++)
                part[t] = _mm512_dpbf16_ps(
                    part[t], qc[c],
                    (__m512bh)_mm512_broadcast_i32x4(
                        _mm_loadu_si128((const __m128i *)(kr[t] + 8 * c))));
        /* keys (4k .. 4k+3) into r[k], lane 4g + i = key 4k + i for head g */
        __m512 r[4];
        for (int k = 0; k < 4; k++) {
            const __m512 *a = part + 4 * k;
            const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]),
                                            _mm512_unpackhi_ps(a[0], a[1]));
            const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]),
                                            _mm512_unpackhi_ps(a[2], a[3]));
            r[k] = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
        }
        __mmask16 valid[4];
        __m512 tmax = _mm512_set1_ps(-INFINITY);
        for (int k = 0; k < 4; k++) {
            /* lane 4g + i is key 4k + i: valid while 4k + i < n */
            const int64_t keys = n - 4 * k < 0 ? 0 : (n - 4 * k > 4 ? 4 : n - 4 * k);
            valid[k] = (__mmask16)(((1u << keys) - 1u) * 0x1111u);
            r[k] = _mm512_mul_ps(r[k], vscale);
            tmax = _mm512_mask_max_ps(tmax, valid[k], tmax, r[k]);
        }
        /* each head's max over its 4 lanes, in all 4 */
        tmax = _mm512_max_ps(tmax, _mm512_permute_ps(tmax, 0xB1));
        tmax = _mm512_max_ps(tmax, _mm512_permute_ps(tmax, 0x4E));
        const __mmask16 grew = _mm512_cmp_ps_mask(tmax, mx, _CMP_GT_OQ);
        if (grew) {
            const __m512 nmx = _mm512_max_ps(mx, tmax);
            /* heads whose max did not grow get alpha = exp(0) = 1; a first max gets ~0 */
            const __m512 alpha = exp16_nonpositive(_mm512_sub_ps(mx, nmx));
            sum = _mm512_mul_ps(sum, alpha);
            for (int g = 0; g < 4; g++) {
                const __m512 ag = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * g), alpha);
                for (int c = 0; c < 4; c++) o[g][c] = _mm512_mul_ps(o[g][c], ag);
            }
            mx = nmx;
        }
        /* pw[k][2g + h]: head g's weights of keys 4k + 2h and 4k + 2h + 1 */
        uint32_t pw[4][8];
        for (int k = 0; k < 4; k++) {
            const __m512 e = _mm512_maskz_mov_ps(valid[k], exp16_nonpositive(_mm512_sub_ps(r[k], mx)));
            sum = _mm512_add_ps(sum, e);
            bf16_weights(e, pw[k]);
        }
        for (int64_t t = 0; t < n; t += 2) {
            __m512bh v[4];
            v_pair(vp + (slot + t) * 64, t + 1 < n, v);
            const uint32_t *w = pw[t / 4] + (t / 2) % 2;
            for (int g = 0; g < 4; g++) {
                add_v_pair(o[g], v, w[2 * g]);
            }
        }
        pos += n;
    }
    float mxs[16], sums[16];
    _mm512_storeu_ps(mxs, mx);
    _mm512_storeu_ps(sums, sum);
    for (int g = 0; g < 4; g++) {
        m[g] = mxs[4 * g];
        l[g] = sums[4 * g] + sums[4 * g + 1] + sums[4 * g + 2] + sums[4 * g + 3];
        store_v_pair_sums(o[g], acc + g * 64);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The scores on AMX tiles where Linux grants them (below, after the tiles' set-up); 0 when it
 * did not attend. */
static int attend_amx_d64(int64_t group, const bf16 *qb, const void *kv, int64_t kv_heads,
                          int64_t slots, int64_t head, const int64_t *table, int64_t block_size,
                          int64_t lo, int64_t hi, float *m, float *l, float *acc, float scale);
#endif

/* Returns 1 when it attended (group 1-4), 0 when the caller must take the generic loop. */
static int attend_bf16_d64(int64_t group, const bf16 *qb, const void *kv, int64_t kv_heads,
                           int64_t slots, int64_t head, const int64_t *table, int64_t block_size,
                           int64_t lo, int64_t hi, float *m, float *l, float *acc, float scale) {
#define ATTEND_G(G) attend_bf16_d64_impl(G, qb, kv, kv_heads, slots, head, table, block_size, \
                                         lo, hi, m, l, acc, scale)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (NEW_DECODE_ATTENTION >= 2 &&
        attend_amx_d64(group, qb, kv, kv_heads, slots, head, table, block_size, lo, hi, m, l,
                       acc, scale))
        return 1;
#endif
    switch (group) {
    case 1: ATTEND_G(1); return 1;
    case 2: ATTEND_G(2); return 1;
    case 3: ATTEND_G(3); return 1;
    case 4: /* the four heads side by side (attend_bf16_d64_g4), not a loop over them */
        attend_bf16_d64_g4(qb, kv, kv_heads, slots, head, table, block_size, lo, hi, m, l, acc,
                           scale);
        return 1;
    default: return 0;
    }
#undef ATTEND_G
}

/* ---- Head size 128 (Llama 3's 3B and 8B, Qwen2.5's 7B, Mistral's 7B), 1-8 query heads a KV
 * head: attend_bf16_d64_impl at twice the width. A head's 8 output vectors would not all fit
 * in registers beside the scores' (4 heads would take all 32), so the unnormalised sums live
 * in `ob` (L1) and each tile adds to them 64 dims and up to 4 heads at a time, each v_pair
 * serving those heads. Without it head size 128 took the generic loop: 9-16 GB/s of KV at 2
 * threads where the head-64 kernel read 13-35 (AMD EPYC Zen 4, session 56). Same contract as
 * attend_range. */
static inline __attribute__((always_inline)) void attend_bf16_d128_impl(
    const int G, const bf16 *qb, const void *kv, int64_t kv_heads, int64_t slots, int64_t head,
    const int64_t *table, int64_t block_size, int64_t lo, int64_t hi, float *m, float *l,
    float *acc, float scale, float *ob) {
    enum { D = 128 };
    /* ob[((g * 2 + half) * 4 + c) * 16 + lane]: head g's dims 64 half.. in v_pair's order */
    __m512 sum[8];
    float mx[8];
    for (int g = 0; g < G; g++) {
        mx[g] = -INFINITY;
        sum[g] = _mm512_setzero_ps();
    }
    memset(ob, 0, (size_t)G * D * sizeof(float));
    const bf16 *kp = (const bf16 *)kv + head * slots * D;
    const bf16 *vp = (const bf16 *)kv + (kv_heads + head) * slots * D;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t pos = lo; pos < hi;) {
        int64_t n;
        const int64_t slot = tile_at(table, block_size, pos, hi, 16, &n);
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        prefetch_tile_after_next_of(D, kp, vp, table, block_size, pos, n, hi, slot);
        uint32_t pw[8][8]; /* pw[g][h]: head g's weights of keys 2h and 2h + 1 */
        for (int g = 0; g < G; g++) {
            __m512bh qv[4];
            for (int c = 0; c < 4; c++)
                qv[c] = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * D + 32 * c));
            __m512 part[16];
            for (int t = 0; t < 16; t++) {
                if (t < n) {
                    const bf16 *kr = kp + (slot + t) * D;
                    __m512 a = _mm512_setzero_ps();
                    for (int c = 0; c < 4; c++)
                        a = _mm512_dpbf16_ps(
                            a, qv[c], (__m512bh)_mm512_loadu_si512((const void *)(kr + 32 * c)));
                    part[t] = a;
                } else {
                    part[t] = _mm512_setzero_ps();
                }
            }
            const __m512 s = _mm512_mul_ps(sum16(part), vscale);
            const float alpha = head_tile_softmax(s, valid, &mx[g], &sum[g], pw[g]);
            if (alpha != 1.0f) { /* a new running max: rescale what was summed so far */
                const __m512 va = _mm512_set1_ps(alpha);
                for (int i = 0; i < 2 * 4 * 16; i += 16) {
                    float *o = ob + g * 2 * 4 * 16 + i;
                    _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), va));
                }
            }
        }
        for (int half = 0; half < 2; half++) {
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int gn = G - g0 < 4 ? G - g0 : 4;
                __m512 o[4][4];
                for (int g = 0; g < gn; g++)
                    for (int c = 0; c < 4; c++)
                        o[g][c] = _mm512_load_ps(ob + (((g0 + g) * 2 + half) * 4 + c) * 16);
                for (int64_t t = 0; t < n; t += 2) {
                    __m512bh v[4];
                    const bf16 *va = vp + (slot + t) * D + 64 * half;
                    v_pair_rows(va, va + D, t + 1 < n, v);
                    for (int g = 0; g < gn; g++) add_v_pair(o[g], v, pw[g0 + g][t / 2]);
                }
                for (int g = 0; g < gn; g++)
                    for (int c = 0; c < 4; c++)
                        _mm512_store_ps(ob + (((g0 + g) * 2 + half) * 4 + c) * 16, o[g][c]);
            }
        }
        pos += n;
    }
    for (int g = 0; g < G; g++) {
        m[g] = mx[g];
        l[g] = _mm512_reduce_add_ps(sum[g]);
        for (int half = 0; half < 2; half++) {
            __m512 o[4];
            for (int c = 0; c < 4; c++) o[c] = _mm512_load_ps(ob + ((g * 2 + half) * 4 + c) * 16);
            store_v_pair_sums(o, acc + g * D + 64 * half);
        }
    }
}

/* Returns 1 when it attended (group 1-8), 0 when the caller must take the generic loop. Out of
 * line, with one `ob` for its eight copies: inlined into attend_range, each copy's buffers
 * would be on every call's frame, whatever its head size (as AVX2_ATTEND's note says). */
__attribute__((noinline)) static int attend_bf16_d128(
    int64_t group, const bf16 *qb, const void *kv, int64_t kv_heads, int64_t slots,
    int64_t head, const int64_t *table, int64_t block_size, int64_t lo, int64_t hi, float *m,
    float *l, float *acc, float scale) {
    float ob[8 * 128] __attribute__((aligned(64)));
#define ATTEND_G(G) attend_bf16_d128_impl(G, qb, kv, kv_heads, slots, head, table, block_size, \
                                          lo, hi, m, l, acc, scale, ob)
    switch (group) {
    case 1: ATTEND_G(1); return 1;
    case 2: ATTEND_G(2); return 1;
    case 3: ATTEND_G(3); return 1;
    case 4: ATTEND_G(4); return 1;
    case 5: ATTEND_G(5); return 1;
    case 6: ATTEND_G(6); return 1;
    case 7: ATTEND_G(7); return 1;
    case 8: ATTEND_G(8); return 1;
    default: return 0;
    }
#undef ATTEND_G
}
#endif

#ifndef HAVE_DPBF16
/* Returns 0: no decode attention of this build has decode_prefetch's prefetches. */
int set_decode_prefetch(int every) {
    (void)every;
    return 0;
}

int decode_prefetch_every(void) { return 0; }
#endif

#ifdef HAVE_AVX2_BF16
/* ---- Decode attention in AVX2 and FMA (a CPU without AVX-512 BF16), head size 64 or 128.
 * attend_range_impl's generic loop ends each key's score in a horizontal sum and keeps its
 * accumulators in memory: ~2.5 GB/s of KV a core, so decode at 4,000 tokens of context read
 * 20 points slower than its bytes. Here the keys go by tiles of 16 while the next tile's rows
 * are fetched; the scores of 8 keys are FMA chains that advance together and are reduced by
 * one hadd tree, the exp is vectorized, and each head's output sums the tile's keys in
 * registers. The softmax weights stay float32. Same contract as attend_range (qf already
 * scaled). 16 keys a tile over 8: 0.95x the time (1 thread, 1,000 and 4,000 keys; an AMD EPYC
 * family 26 running its x86-64-v3 build); over 32: 1.1x (the Xeon below).
 * bf16 rows are widened by unpacking with zero (one load and two unpacks for 16 values, where
 * a widening and a shift took 8), which leaves each 16 dims in the order [0-3, 8-11, 4-7,
 * 12-15]: q is put in that order once a call and the output put back, so the scores and sums
 * are the same dot products. A whole bf16 tile is read where it lies and unpacked in
 * registers, each load serving up to 4 query heads (qk8_bf16, pv_bf16); a short tile, or a
 * float32 cache's K, goes through a float32 copy in L1 as before. On an Intel Xeon with AMX
 * running its x86-64-v3 build (2 threads, 4,000 keys of the small model's shapes, the KV read
 * from memory after 25 MB of other reads, as after a layer's weights): 0.86x the time of
 * widening every K and V row into L1 (0.80x where the rows are in L2); unpacking alone there
 * was 0.95x. What a key cost before (removing each part in turn, 1 thread, 21.5 ns a key and
 * KV head): QK 36%, P.V 30%, widening 22%, exp 9%: the FMAs, not memory, set the pace.
 * On an AMD EPYC Zen 2 (perf's cpu-clock samples, KV in cache, 25.7 ns a key and KV head)
 * before its prefetches were spread and its softmax sums kept by lane: QK 44%, P.V 25%,
 * softmax 15%, the next tile's prefetch loop 13%; after, 20.3 ns, ~45 cycles where its 64
 * FMAs take 32. */

/* out[t] = the sum of the 8 lanes of v[t] */
static inline __m256 sum8x8(const __m256 v[8]) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* ab's low half holds keys 0-3's sums of lanes 0-3, its high half their lanes 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

static inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0, 8 lanes, as exp16_nonpositive: below -87 it is ~1e-38 */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = EXP_REDUCE(_mm256_fnmadd_ps, _mm256_set1_ps, n, x);
    const __m256 p = EXP_TERMS(_mm256_fmadd_ps, _mm256_set1_ps, r);
    /* 2^n for n in [-126, 0]: the exponent field alone */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 16 bf16 at p widened into dst as float32 in the order of the unpacks, dims
 * [0-3, 8-11, 4-7, 12-15]: one load and two unpacks with zero for 16 values, where
 * widening 8 (vpmovzxwd) and a shift took a load and two instructions for 8. */
static inline void widen16_unpacked(const bf16 *p, float *dst) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    _mm256_storeu_si256((__m256i *)dst, _mm256_unpacklo_epi16(z, x));
    _mm256_storeu_si256((__m256i *)(dst + 8), _mm256_unpackhi_epi16(z, x));
}

/* 16 bf16 at p (of a K, V or weight row) as float32: dims [0-3, 8-11] (half 0) or
 * [4-7, 12-15] (half 1) */
static inline __m256 unpack16_half(const bf16 *p, const int half) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    return _mm256_castsi256_ps(half ? _mm256_unpackhi_epi16(z, v) : _mm256_unpacklo_epi16(z, v));
}

/* Swap dims 4-7 and 8-11 of every 16 in n floats (n a multiple of 16: group * 64 or 128):
 * the unpacked order and back (it undoes itself). */
static inline void swap_unpacked(float *x, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        const __m128 a = _mm_loadu_ps(x + c + 4), b = _mm_loadu_ps(x + c + 8);
        _mm_storeu_ps(x + c + 4, b);
        _mm_storeu_ps(x + c + 8, a);
    }
}

/* Bytes [lo, hi) of the K rows from k and the V rows from v into L1, a line of each in turn */
static inline void prefetch_kv_rows(const char *k, const char *v, int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; c += 64) {
        _mm_prefetch(k + c, _MM_HINT_T0);
        _mm_prefetch(v + c, _MM_HINT_T0);
        KEEP_LOOP();
    }
}

#ifndef AVX2_TILE_HALVES
#define AVX2_TILE_HALVES 2 /* keys a tile: 8 a half (-DAVX2_TILE_HALVES=1 for 8 keys) */
#endif

/* The scores of 8 keys (rows of D bf16 from k0) for query heads [g0, g0 + HS), HS * KS = 8,
 * K unpacked in registers as widen16_unpacked orders it (q is in that order): KS keys at a
 * time, HS * KS FMA chains, each pair of keys' chains reduced by the first level of sum8x8's
 * tree into fl, the rest of the tree once all 8 are in. s[h] gets head g0 + h's 8 scores. */
static inline __attribute__((always_inline)) void qk8_bf16(const int D, const int HS,
                                                           const int KS, const bf16 *k0,
                                                           const float *q, int64_t g0,
                                                           __m256 *s) {
    __m256 fl[4][4]; /* [head][key pair] */
    for (int t0 = 0; t0 < 8; t0 += KS) {
        __m256 a[8]; /* head h, key t: a[h * KS + t] */
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int c = 0; c < D; c += 16)
            for (int t = 0; t < KS; t++) {
                const __m256 lo = unpack16_half(k0 + (t0 + t) * D + c, 0);
                const __m256 hi = unpack16_half(k0 + (t0 + t) * D + c, 1);
                for (int h = 0; h < HS; h++) {
                    const float *qh = q + (g0 + h) * D + c;
                    a[h * KS + t] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), lo, a[h * KS + t]);
                    a[h * KS + t] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), hi, a[h * KS + t]);
                }
            }
        for (int h = 0; h < HS; h++)
            for (int t = 0; t < KS; t += 2)
                fl[h][(t0 + t) / 2] = _mm256_hadd_ps(a[h * KS + t], a[h * KS + t + 1]);
    }
    for (int h = 0; h < HS; h++) {
        const __m256 ab = _mm256_hadd_ps(fl[h][0], fl[h][1]);
        const __m256 cd = _mm256_hadd_ps(fl[h][2], fl[h][3]);
        s[h] = _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                             _mm256_permute2f128_ps(ab, cd, 0x31));
    }
}

/* P.V of one tile for query heads [g0, g0 + HS) over dims [c0, c0 + 16 * CS), V's n rows
 * (from v0, D bf16 each) unpacked in registers in widen16_unpacked's order, so each V load
 * serves HS heads with no float32 copy: 2 * HS * CS accumulators (8 in every use). w holds
 * each head's weights, a row of `stride` per head; acc is in the unpacked order. */
static inline __attribute__((always_inline)) void pv_bf16(const int D, const int HS, const int CS,
                                                          const bf16 *v0, int64_t n,
                                                          const float *w, const int stride,
                                                          int64_t g0, float *acc, int c0) {
    __m256 o[8]; /* head h, chunk c, half j: o[(h * CS + c) * 2 + j] */
    for (int h = 0; h < HS; h++)
        for (int i = 0; i < 2 * CS; i++)
            o[h * 2 * CS + i] = _mm256_loadu_ps(acc + (g0 + h) * D + c0 + 8 * i);
    for (int64_t t = 0; t < n; t++)
        for (int c = 0; c < CS; c++) {
            const __m256 lo = unpack16_half(v0 + t * D + c0 + 16 * c, 0);
            const __m256 hi = unpack16_half(v0 + t * D + c0 + 16 * c, 1);
            for (int h = 0; h < HS; h++) {
                const __m256 wt = _mm256_broadcast_ss(w + (g0 + h) * stride + t);
                o[(h * CS + c) * 2] = _mm256_fmadd_ps(wt, lo, o[(h * CS + c) * 2]);
                o[(h * CS + c) * 2 + 1] = _mm256_fmadd_ps(wt, hi, o[(h * CS + c) * 2 + 1]);
            }
        }
    for (int h = 0; h < HS; h++)
        for (int i = 0; i < 2 * CS; i++)
            _mm256_storeu_ps(acc + (g0 + h) * D + c0 + 8 * i, o[h * 2 * CS + i]);
}

static inline __attribute__((always_inline)) void attend_avx2_impl(
    const int D, const int BF, const float *qf, int64_t group, const void *kv, int64_t kv_heads,
    int64_t slots, int64_t head, const int64_t *table, int64_t block_size, int64_t lo,
    int64_t hi, float *m, float *l, float *acc) {
    enum { H = AVX2_TILE_HALVES, T = 8 * AVX2_TILE_HALVES };
    float kt[T * D] __attribute__((aligned(32)));
    float w[group][T] __attribute__((aligned(32)));
    __m256 sc[group][H]; /* each query head's scores of the tile */
    float qp[BF ? group * D : 1]; /* bf16: q in the unpacked order of the tiles' dims */
    if (BF) {
        memcpy(qp, qf, (size_t)(group * D) * sizeof(float));
        swap_unpacked(qp, group * D);
        qf = qp;
    }
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int64_t i = 0; i < D; i++) acc[g * D + i] = 0.0f;
    }
    const int64_t k_plane = head * slots, v_plane = (kv_heads + head) * slots;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    /* each head's softmax sum by lane, added up once at the end: a sum of 8 lanes a tile and
     * head was ~5% of the kernel's time on an AMD EPYC Zen 2 (1 thread, KV in cache) */
    __m256 lv[group];
    for (int64_t g = 0; g < group; g++) lv[g] = _mm256_setzero_ps();
    for (int64_t pos = lo; pos < hi;) {
        int64_t n;
        const int64_t slot = tile_at(table, block_size, pos, hi, T, &n);
        /* The next tile's K and V rows, asked for while this one computes: without, the
         * loads below waited on memory (1 thread at 4,000 keys: 0.79x the time with, 0.70x at
         * 1,000, on an AMD EPYC family 26; decode_attention_ab.py --march x86-64-v3; on the
         * Xeon with AMX, 2 threads, the KV read from memory: 0.69-0.79x). Further ahead, into
         * L2 as well: no faster there. Where the next tile is one run of T rows (a block of
         * 16 or more holds it), its rows are asked for in parts spread over this tile's work
         * (a quarter before each half's scores, or half before a short or float32 tile's; a
         * quarter before the softmax; the rest before P.V): all 64 lines at once filled the
         * core's misses in flight, and this tile's own loads waited behind them. On an AMD
         * EPYC Zen 2 (bench/attend_avx2_micro.c: 1 thread, 12 layers of 4,000 keys, the KV
         * from memory) a key and KV head took 0.51x the time so, 0.74x where the table's
         * blocks are shuffled. */
        const int64_t rb = D * (BF ? 2 : 4), next = pos + n; /* rb: bytes a K or V row */
        const char *nk = NULL, *nv = NULL; /* the next tile's first K and V row, one run */
        if (next + T <= hi && block_size - next % block_size >= T) {
            const int64_t row = table[next / block_size] * block_size + next % block_size;
            nk = (const char *)kv + (k_plane + row) * rb;
            nv = (const char *)kv + (v_plane + row) * rb;
        } else {
            for (int64_t p = next; p < next + T && p < hi; p++) {
                const int64_t row = table[p / block_size] * block_size + p % block_size;
                prefetch_kv_rows((const char *)kv + (k_plane + row) * rb,
                                 (const char *)kv + (v_plane + row) * rb, 0, rb);
            }
        }
        __m256 valid[H];
        for (int h = 0; h < H; h++)
            valid[h] = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - 8 * h)), lane));
        if (BF && n == T) { /* a whole bf16 tile: K unpacked in registers, up to 4 heads a load */
            const bf16 *k0 = (const bf16 *)kv + (k_plane + slot) * D;
            for (int h = 0; h < H; h++) {
                if (nk) prefetch_kv_rows(nk, nv, h * T / 4 * rb, (h + 1) * T / 4 * rb);
                __m256 r[4];
                int64_t g = 0;
                for (; g + 4 <= group; g += 4) {
                    qk8_bf16(D, 4, 2, k0 + 8 * h * D, qf, g, r);
                    for (int j = 0; j < 4; j++) sc[g + j][h] = r[j];
                }
                if (group - g >= 2) {
                    qk8_bf16(D, 2, 4, k0 + 8 * h * D, qf, g, r);
                    for (int j = 0; j < 2; j++) sc[g + j][h] = r[j];
                    g += 2;
                }
                if (group - g == 1) qk8_bf16(D, 1, 8, k0 + 8 * h * D, qf, g, &sc[g][h]);
            }
        } else {
            if (nk) prefetch_kv_rows(nk, nv, 0, H * T / 4 * rb);
            /* K as float32 into L1, once for every query head; a short tile's missing keys
             * score 0, masked below (never NaN) */
            if (BF) {
                const bf16 *k0 = (const bf16 *)kv + (k_plane + slot) * D;
                for (int64_t t = 0; t < n; t++)
                    for (int c = 0; c < D; c += 16)
                        widen16_unpacked(k0 + t * D + c, kt + t * D + c);
            } else {
                const float *k0 = (const float *)kv + (k_plane + slot) * D;
                for (int64_t t = 0; t < n; t++)
                    for (int c = 0; c < D; c += 8)
                        _mm256_store_ps(kt + t * D + c, _mm256_loadu_ps(k0 + t * D + c));
            }
            if (n < T) memset(kt + n * D, 0, (size_t)(T - n) * D * sizeof(float));
            for (int64_t g = 0; g < group; g++)
                for (int h = 0; h < H; h++) {
                    const float *k = kt + 8 * h * D, *q = qf + g * D;
                    __m256 part[8];
                    for (int t = 0; t < 8; t++) part[t] = _mm256_setzero_ps();
                    for (int c = 0; c < D; c += 8) {
                        const __m256 qc = _mm256_loadu_ps(q + c);
                        for (int t = 0; t < 8; t++)
                            part[t] = _mm256_fmadd_ps(qc, _mm256_load_ps(k + t * D + c), part[t]);
                    }
                    sc[g][h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sum8x8(part), valid[h]);
                }
        }
        if (nk) prefetch_kv_rows(nk, nv, H * T / 4 * rb, (H + 1) * T / 4 * rb);
        for (int64_t g = 0; g < group; g++) {
            const __m256 *s = sc[g];
            __m256 top = s[0];
            for (int h = 1; h < H; h++) top = _mm256_max_ps(top, s[h]);
            const float smax = max8(top);
            if (smax > m[g]) {
                const float alpha = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - smax);
                const __m256 va = _mm256_set1_ps(alpha);
                for (int c = 0; c < D; c += 8)
                    _mm256_storeu_ps(acc + g * D + c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + c), va));
                lv[g] = _mm256_mul_ps(lv[g], va);
                m[g] = smax;
            }
            const __m256 mg = _mm256_set1_ps(m[g]);
            for (int h = 0; h < H; h++) {
                const __m256 e = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(s[h], mg)), valid[h]);
                lv[g] = _mm256_add_ps(lv[g], e);
                _mm256_store_ps(w[g] + 8 * h, e);
            }
        }
        if (nk) prefetch_kv_rows(nk, nv, (H + 1) * T / 4 * rb, T * rb);
        if (BF) { /* P.V, V unpacked in registers, each load for up to 4 heads */
            const bf16 *v0 = (const bf16 *)kv + (v_plane + slot) * D;
            int64_t g = 0;
            for (; g + 4 <= group; g += 4)
                for (int c0 = 0; c0 < D; c0 += 16) pv_bf16(D, 4, 1, v0, n, &w[0][0], T, g, acc, c0);
            if (group - g >= 2) {
                for (int c0 = 0; c0 < D; c0 += 32) pv_bf16(D, 2, 2, v0, n, &w[0][0], T, g, acc, c0);
                g += 2;
            }
            if (group - g == 1)
                for (int c0 = 0; c0 < D; c0 += 64) pv_bf16(D, 1, 4, v0, n, &w[0][0], T, g, acc, c0);
        } else {
            const float *v0 = (const float *)kv + (v_plane + slot) * D;
            for (int64_t g = 0; g < group; g++)
                for (int c0 = 0; c0 < D; c0 += 64) {
                    float *ag = acc + g * D + c0;
                    __m256 o[8];
                    for (int c = 0; c < 8; c++) o[c] = _mm256_loadu_ps(ag + 8 * c);
                    for (int64_t t = 0; t < n; t++) {
                        const __m256 wt = _mm256_set1_ps(w[g][t]);
                        for (int c = 0; c < 8; c++)
                            o[c] = _mm256_fmadd_ps(
                                wt, _mm256_loadu_ps(v0 + t * D + c0 + 8 * c), o[c]);
                    }
                    for (int c = 0; c < 8; c++) _mm256_storeu_ps(ag + 8 * c, o[c]);
                }
        }
        pos += n;
    }
    for (int64_t g = 0; g < group; g++) l[g] = sum8(lv[g]);
    if (BF) swap_unpacked(acc, group * D); /* the sums of V's unpacked dims, back in order */
}

/* A function per head size and cache type, each with a frame of its own: inlined into
 * attend_range, the four copies' tile buffers made a ~50 KB frame (gcc -fstack-usage) on every
 * call, a risk under a small OMP_STACKSIZE. */
#define AVX2_ATTEND(D, BF)                                                                     \
    __attribute__((noinline)) static void attend_avx2_##D##_##BF(                              \
        const float *qf, int64_t group, const void *kv, int64_t kv_heads, int64_t slots,       \
        int64_t head, const int64_t *table, int64_t block_size, int64_t lo, int64_t hi,        \
        float *m, float *l, float *acc) {                                                      \
        attend_avx2_impl(D, BF, qf, group, kv, kv_heads, slots, head, table, block_size, lo,   \
                         hi, m, l, acc);                                                       \
    }
AVX2_ATTEND(64, 1)
AVX2_ATTEND(64, 0)
AVX2_ATTEND(128, 1)
AVX2_ATTEND(128, 0)
#undef AVX2_ATTEND
#endif

/* Common head sizes get their own copy with the size known at compile time, so the per-key
 * loops unroll into a few vector instructions. */
static void attend_range(const float *qf, int64_t group, int64_t dim, const void *kv,
                         int64_t kv_heads, int64_t slots, int64_t head, const int64_t *table,
                         int64_t block_size, int64_t lo, int64_t hi, int bf, float *m, float *l,
                         float *acc, const bf16 *qb, float scale) {
#define ATTEND(D, QB) attend_range_impl(qf, group, D, kv, kv_heads, slots, head, table, \
                                        block_size, lo, hi, bf, m, l, acc, QB, scale)
#ifdef HAVE_DPBF16
    if (dim == 64 && bf && qb && NEW_DECODE_ATTENTION &&
        attend_bf16_d64(group, qb, kv, kv_heads, slots, head, table, block_size, lo, hi, m, l,
                        acc, scale))
        return;
    if (dim == 128 && bf && qb && NEW_DECODE_ATTENTION &&
        attend_bf16_d128(group, qb, kv, kv_heads, slots, head, table, block_size, lo, hi, m, l,
                         acc, scale))
        return;
    if (dim == 64 && bf && group <= 8) ATTEND(64, qb);
    else
#endif
#ifdef HAVE_AVX2_BF16
#define AVX2(D, BF) attend_avx2_##D##_##BF(qf, group, kv, kv_heads, slots, head, table, \
                                        block_size, lo, hi, m, l, acc)
    if (NEW_DECODE_ATTENTION && (dim == 64 || dim == 128)) {
        if (dim == 64 && bf) AVX2(64, 1);
        else if (dim == 64) AVX2(64, 0);
        else if (bf) AVX2(128, 1);
        else AVX2(128, 0);
        return;
    }
#undef AVX2
#endif
    if (dim == 64 && bf) ATTEND(64, NULL);
    else if (dim == 128 && bf) ATTEND(128, NULL);
    else ATTEND(dim, NULL);
#undef ATTEND
}

/* Item it's output rows from its parts' running max, sum and unnormalised sums in `parts`
 * (each group * (dim + 2) floats: m, l, acc), merged by their max and sum. */
static void merge_parts(const float *parts_base, int64_t parts, int64_t group, int64_t dim,
                        void *out, int64_t first_row, int bf) {
    for (int64_t g = 0; g < group; g++) {
        float mx = -INFINITY;
        for (int64_t p = 0; p < parts; p++) {
            float mp = parts_base[p * group * (dim + 2) + g];
            mx = mp > mx ? mp : mx;
        }
        float row[dim], total_l = 0.0f;
        for (int64_t i = 0; i < dim; i++) row[i] = 0.0f;
        for (int64_t p = 0; p < parts; p++) {
            const float *base = parts_base + p * group * (dim + 2);
            if (base[g] == -INFINITY) continue; /* an empty part */
            float wgt = exp_nonpositive(base[g] - mx);
            total_l += base[group + g] * wgt;
            const float *acc = base + 2 * group + g * dim;
            for (int64_t i = 0; i < dim; i++) row[i] += acc[i] * wgt;
        }
        const float inv = total_l > 0.0f ? 1.0f / total_l : 0.0f;
        for (int64_t i = 0; i < dim; i++) row[i] *= inv;
        store_f32(out, (first_row + g) * dim, dim, row, bf);
    }
}

/* Work item w of paged_decode_attention: (sequence, kv head, context part). With `scratch`
 * the part's running max, sum and unnormalised sums go there for the merge; without, the item
 * is the whole context and writes its output rows itself. */
static void attend_item(const void *q, const void *kv, void *out, const int64_t *tables,
                        const int64_t *bounds, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t slots, int64_t block_size, int64_t table_width, float scale,
                        int bf, int64_t parts, int64_t width, float *scratch, int64_t w) {
    const int64_t group = heads / kv_heads;
    const int64_t d = w / (kv_heads * parts), h = (w / parts) % kv_heads, part = w % parts;
    const int64_t lo0 = bounds[2 * d], hi0 = bounds[2 * d + 1];
    int64_t lo = lo0 + part * width, hi = lo + width;
    hi = hi < hi0 ? hi : hi0;
    float own[scratch ? 1 : group * (dim + 2)];
    float *m = scratch ? scratch + w * group * (dim + 2) : own, *l = m + group, *acc = l + group;
    float qf[group * dim];
    load_f32(q, (d * heads + h * group) * dim, group * dim, qf, bf);
    for (int64_t i = 0; i < group * dim; i++) qf[i] *= scale;
    if (lo < hi) {
        attend_range(qf, group, dim, kv, kv_heads, slots, h, tables + d * table_width,
                     block_size, lo, hi, bf, m, l, acc,
                     bf ? (const bf16 *)q + (d * heads + h * group) * dim : NULL, scale);
    } else {
        for (int64_t g = 0; g < group; g++) m[g] = -INFINITY, l[g] = 0.0f;
    }
    if (!scratch) merge_parts(m, 1, group, dim, out, d * heads + h * group, bf);
}

/* Items [lo, hi) of the merge: each (sequence, kv head)'s parts merged into its output rows. */
static void merge_items(const float *scratch, int64_t parts, int64_t heads, int64_t kv_heads,
                        int64_t dim, void *out, int bf, int64_t lo, int64_t hi) {
    const int64_t group = heads / kv_heads;
    for (int64_t it = lo; it < hi; it++)
        merge_parts(scratch + it * parts * group * (dim + 2), parts, group, dim, out,
                    (it / kv_heads) * heads + (it % kv_heads) * group, bf);
}

/* The most parts paged_decode_attention cuts `items` (sequence, kv head) pairs into at
 * `threads`: items * parts < 4 * threads where there is more than one part. */
static int64_t attention_parts(int64_t items, int64_t longest, int threads) {
    int64_t parts = 1;
    if (threads > 1 && items < 2 * threads) {
        parts = (2 * threads + items - 1) / items;
        const int64_t most = longest / 256;
        parts = parts < most ? parts : most;
        parts = parts < 1 ? 1 : parts;
    }
    return parts;
}

/* Decode attention for `seqs` sequences, one query token each, read straight from the paged
 * cache through each sequence's block table: no gather copy, no padding, no mask.
 *   q [seqs, heads, dim], out [seqs, heads, dim] (model dtype)
 *   tables [seqs, table_width] int64 block ids; bounds [seqs, 2] int64: keys [lo, hi) attended
 * Work is split over (sequence, kv head, context part): a long context with few sequences is
 * cut into parts attended in parallel and merged by their max and sum (flash decoding).
 * Returns 0, or -1 when its scratch memory could not be allocated. */
int paged_decode_attention(const void *q, const void *kv, void *out, const int64_t *tables,
                           const int64_t *bounds, int64_t seqs, int64_t heads, int64_t kv_heads,
                           int64_t dim, int64_t slots, int64_t block_size, int64_t table_width,
                           float scale, int bf, int threads) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 1, total = 0;
    for (int64_t d = 0; d < seqs; d++) {
        int64_t len = bounds[2 * d + 1] - bounds[2 * d];
        longest = len > longest ? len : longest;
        total += len;
    }
    /* Parts: enough work items for every thread, none shorter than 256 keys. */
    const int64_t items = seqs * kv_heads, parts = attention_parts(items, longest, threads);
    const int64_t width = (longest + parts - 1) / parts, work = items * parts;
    team_member *tm = step_member;
    /* One part an item (one thread, two items a thread or more, or fewer than 512 keys):
     * each item writes its rows where it is attended, from scratch on its thread's stack. A
     * batch-32 step's 128 items a layer otherwise shared a malloc past glibc's mmap threshold
     * (an mmap, its page faults and a munmap every layer) and a merge run on one thread. In a
     * step's team the parts go in the step's scratch. */
    float *scratch = NULL;
    if (parts > 1) {
        scratch = tm ? tm->state->att_parts
                     : malloc((size_t)(work * group * (dim + 2)) * sizeof(float));
        if (!scratch) return -1;
    }
    /* Below ~512 key rows a parallel region costs about what it saves. On an AMD EPYC at 2
     * threads, 2,400 rows took 0.62 of their one-thread time and 512 rows 0.85
     * (bench/decode_attention_ab.py --ab-source); the bound was 8,192 rows before. */
    const int parallel = threads > 1 && total * kv_heads >= 512;
#define ATTEND_ITEM(w) \
    attend_item(q, kv, out, tables, bounds, heads, kv_heads, dim, slots, block_size, \
                table_width, scale, bf, parts, width, scratch, w)
    if (tm) {
        /* Items handed out in turn, as schedule(dynamic, 1) does: each thread takes tickets
         * until one falls past the work, so the loop uses work + n tickets in all. */
        if (parallel) {
            for (;;) {
                const int64_t w =
                    __atomic_fetch_add(&tm->state->ticket, 1, __ATOMIC_RELAXED) - tm->ticket_base;
                if (w >= work) break;
                ATTEND_ITEM(w);
            }
            tm->ticket_base += work + tm->n;
            team_barrier(tm);
        } else {
            if (tm->id == 0)
                for (int64_t w = 0; w < work; w++) ATTEND_ITEM(w);
            team_serial_done(tm);
        }
        if (scratch) FOR_SHARE(items, parallel, threads,
                               merge_items(scratch, parts, heads, kv_heads, dim, out, bf, lo, hi));
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (parallel)
    for (int64_t w = 0; w < work; w++) ATTEND_ITEM(w);
#undef ATTEND_ITEM
    if (!scratch) return 0;
    merge_items(scratch, parts, heads, kv_heads, dim, out, bf, 0, items);
    free(scratch);
    return 0;
}

/* RMS norm of one row in float: x / sqrt(mean(x^2) + eps) * w. */
static inline void rms_row(float *x, int64_t n, const void *w, float eps, int bf) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    if (bf) {
        const bf16 *wb = (const bf16 *)w;
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv * bf16_to_f32(wb[i]);
    } else {
        const float *wf = (const float *)w;
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv * wf[i];
    }
}

/* After the fused q/k/v projection of `tokens` tokens: optional per-head RMS norm of q and k
 * (Qwen3; weights NULL otherwise), rotary embedding of q and k at each token's position, K and
 * V written into their cache slots, rotated q written to q_out [tokens, heads, dim].
 * One call replaces the slices, norms, rope ops and two index_copy_ of the PyTorch path.
 * heads_major: q_out is [heads, tokens, dim] instead (qkv_rope_store_heads, below). */
static void rope_range(const void *qkv, void *q_out, void *kv, const int64_t *positions,
                       const int64_t *slot_mapping, const float *cos_table,
                       const float *sin_table, const void *q_norm, const void *k_norm, float eps,
                       int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                       int64_t slots, int bf, int heads_major, int64_t lo, int64_t hi) {
    const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
    const size_t elem = bf ? sizeof(bf16) : sizeof(float);
    for (int64_t t = lo; t < hi; t++) {
        const float *c = cos_table + positions[t] * dim, *s = sin_table + positions[t] * dim;
        const int64_t slot = slot_mapping[t];
        float x[dim], y[dim];
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {
            load_f32(qkv, t * width + hd * dim, dim, x, bf);
            const void *norm = hd < heads ? q_norm : k_norm;
            if (norm) rms_row(x, dim, norm, eps, bf);
            for (int64_t i = 0; i < half; i++) y[i] = x[i] * c[i] + x[i + half] * s[i];
            for (int64_t i = half; i < dim; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
            if (hd < heads) {
                const int64_t row = heads_major ? hd * tokens + t : t * heads + hd;
                store_f32(q_out, row * dim, dim, y, bf);
            } else {
                store_f32(kv, ((hd - heads) * slots + slot) * dim, dim, y, bf);
            }
        }
        for (int64_t hv = 0; hv < kv_heads; hv++) { /* V goes in as computed: no rounding */
            memcpy((char *)kv + (((kv_heads + hv) * slots + slot) * dim) * elem,
                   (const char *)qkv + (t * width + (heads + kv_heads + hv) * dim) * elem,
                   (size_t)dim * elem);
        }
    }
}

static void rope_store(const void *qkv, void *q_out, void *kv, const int64_t *positions,
                       const int64_t *slot_mapping, const float *cos_table,
                       const float *sin_table, const void *q_norm, const void *k_norm, float eps,
                       int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                       int64_t slots, int bf, int threads, int heads_major) {
    const int parallel = threads > 1 && tokens * (heads + 2 * kv_heads) * dim >= 65536;
    FOR_SHARE(tokens, parallel, threads,
              rope_range(qkv, q_out, kv, positions, slot_mapping, cos_table, sin_table, q_norm,
                         k_norm, eps, tokens, heads, kv_heads, dim, slots, bf, heads_major, lo,
                         hi));
}

void qkv_rope_store(const void *qkv, void *q_out, void *kv, const int64_t *positions,
                    const int64_t *slot_mapping, const float *cos_table,
                    const float *sin_table, const void *q_norm, const void *k_norm, float eps,
                    int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t slots,
                    int bf, int threads) {
    rope_store(qkv, q_out, kv, positions, slot_mapping, cos_table, sin_table, q_norm, k_norm,
               eps, tokens, heads, kv_heads, dim, slots, bf, threads, 0);
}

/* out = rms_norm(x) * w over rows of n; with `residual` non-NULL, first residual += x (rounded
 * to the model dtype, as PyTorch's `x + h` is) and the sum is normalized: the residual add and
 * the next norm of a decoder layer in one pass. */
static void rms_norm_range(const void *x, void *residual, const void *w, void *out, int64_t n,
                           float eps, int bf, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
        float row[n];
        load_f32(x, r * n, n, row, bf);
        if (residual) {
            float res[n];
            load_f32(residual, r * n, n, res, bf);
            for (int64_t i = 0; i < n; i++) row[i] += res[i];
            store_f32(residual, r * n, n, row, bf);
            if (bf) load_f32(residual, r * n, n, row, bf); /* normalize the rounded sum */
        }
        rms_row(row, n, w, eps, bf);
        store_f32(out, r * n, n, row, bf);
    }
}

void rms_norm(const void *x, void *residual, const void *w, void *out, int64_t rows, int64_t n,
              float eps, int bf, int threads) {
    const int parallel = threads > 1 && rows * n >= 65536;
    FOR_SHARE(rows, parallel, threads, rms_norm_range(x, residual, w, out, n, eps, bf, lo, hi));
}

/* out [rows, n] = silu(gate) * up, from gate_up [rows, 2n] (the fused projection's output:
 * gate in the first half of each row, up in the second). silu(x) = x * sigmoid(x), with the
 * exponential taken of -|x| only, so exp_nonpositive covers it; one rounding at the end where
 * PyTorch's silu then mul_ round twice. */
static void silu_mul_range(const void *gate_up, void *out, int64_t n, int bf, int64_t lo,
                           int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
        for (int64_t i0 = 0; i0 < n; i0 += 256) { /* fixed-size pieces: gcc vectorizes these */
            const int64_t m = n - i0 < 256 ? n - i0 : 256;
            float g[256], u[256];
            load_f32(gate_up, r * 2 * n + i0, m, g, bf);
            load_f32(gate_up, r * 2 * n + n + i0, m, u, bf);
#pragma omp simd
            for (int64_t i = 0; i < m; i++) {
                /* sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below, e = exp(-|x|)
                 * (never a difference of nearly equal terms). The numerator is picked by the
                 * sign bit with integer masks: no branch to stop gcc vectorizing the loop. */
                const float x = g[i], e = exp_neg_abs(x), one = 1.0f;
                int32_t xb, eb, ob;
                memcpy(&xb, &x, sizeof xb);
                memcpy(&eb, &e, sizeof eb);
                memcpy(&ob, &one, sizeof ob);
                const int32_t negative = xb >> 31; /* all ones below zero (and for -0) */
                const int32_t nb = (eb & negative) | (ob & ~negative);
                float num;
                memcpy(&num, &nb, sizeof num);
                g[i] = x * (num / (1.0f + e)) * u[i];
            }
            store_f32(out, r * n + i0, m, g, bf);
        }
    }
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int bf, int threads) {
    const int parallel = threads > 1 && rows * n >= 65536;
    FOR_SHARE(rows, parallel, threads, silu_mul_range(gate_up, out, n, bf, lo, hi));
}

/* ---- The prefill glue at full AVX-512 width, bf16 only. The loops above go through float
 * buffers and the portable bf16 conversions, which gcc vectorizes at 256 bits; a 2,000-token
 * chunk's norms and silu(gate) * up are then ~15% of a prefill layer's time on one core (AMX
 * Xeon). These take 16 lanes at a time straight from bf16 and round with vcvtneps2bf16
 * (nearest even, as f32_to_bf16; it flushes subnormals, below 1.2e-38, to zero). Tails are
 * masked, so any width works. Same math and rounding points as rms_norm and silu_mul. */
#if defined(HAVE_DPBF16)
static inline __m512 load16_bf16(const bf16 *p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline void store16_bf16(bf16 *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __mmask16 tail16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* exp(-|x|) on 16 lanes: exp_neg_abs's clamp, range reduction and polynomial. */
static inline __m512 exp_neg_abs16(__m512 x) {
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(87.0f));
    const __m512 t = _mm512_mul_ps(a, _mm512_set1_ps(-1.44269504088896341f));
    const __m512i n = _mm512_cvttps_epi32(_mm512_sub_ps(t, _mm512_set1_ps(0.5f)));
    const __m512 nf = _mm512_cvtepi32_ps(n);
    const __m512 r =
        EXP_REDUCE(_mm512_fnmadd_ps, _mm512_set1_ps, nf, _mm512_sub_ps(_mm512_setzero_ps(), a));
    const __m512 p = EXP_TERMS(_mm512_fmadd_ps, _mm512_set1_ps, r);
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

/* Whether rms_norm_bf16 and silu_mul_bf16 are built (1: the CPU has AVX-512 BF16). */
int prefill_glue_isa(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}

/* rms_norm for bf16: out = rms_norm(x) * w; with `residual`, first residual += x (rounded to
 * bf16) and the rounded sum is normalized. A no-op where prefill_glue_isa() is 0. */
#ifdef HAVE_DPBF16
static void rms_norm_bf16_range(const bf16 *x, bf16 *residual, const bf16 *w, bf16 *out,
                                int64_t n, float eps, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
        const bf16 *xr = x + r * n;
        bf16 *res = residual ? residual + r * n : NULL, *o = out + r * n;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = tail16(n - i);
            __m512 v = load16_bf16(xr + i, m);
            if (res) {
                const __m256bh s = _mm512_cvtneps_pbh(_mm512_add_ps(v, load16_bf16(res + i, m)));
                _mm256_mask_storeu_epi16(res + i, m, (__m256i)s);
                v = _mm512_cvtpbh_ps(s);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
        const bf16 *src = res ? res : xr;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = tail16(n - i);
            const __m512 v = _mm512_mul_ps(load16_bf16(src + i, m), inv);
            store16_bf16(o + i, _mm512_mul_ps(v, load16_bf16(w + i, m)), m);
        }
    }
}
#endif

void rms_norm_bf16(const bf16 *x, bf16 *residual, const bf16 *w, bf16 *out, int64_t rows,
                   int64_t n, float eps, int threads) {
#ifdef HAVE_DPBF16
    const int parallel = threads > 1 && rows * n >= 65536;
    FOR_SHARE(rows, parallel, threads, rms_norm_bf16_range(x, residual, w, out, n, eps, lo, hi));
#else
    (void)x, (void)residual, (void)w, (void)out, (void)rows, (void)n, (void)eps, (void)threads;
#endif
}

/* silu_mul for bf16: out [rows, n] = silu(gate) * up from gate_up [rows, 2n], one rounding.
 * A no-op where prefill_glue_isa() is 0. */
#ifdef HAVE_DPBF16
static void silu_mul_bf16_range(const bf16 *gate_up, bf16 *out, int64_t n, int64_t lo,
                                int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
        const bf16 *g = gate_up + r * 2 * n, *u = g + n;
        bf16 *o = out + r * n;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = tail16(n - i);
            const __m512 x = load16_bf16(g + i, m), e = exp_neg_abs16(x);
            /* sigmoid: 1 / (1 + e) for x >= 0, e / (1 + e) below (sign bit set, -0 too) */
            const __mmask16 negative = _mm512_movepi32_mask(_mm512_castps_si512(x));
            const __m512 num = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.0f), e);
            const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            store16_bf16(o + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), load16_bf16(u + i, m)), m);
        }
    }
}
#endif

void silu_mul_bf16(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t n, int threads) {
#ifdef HAVE_DPBF16
    const int parallel = threads > 1 && rows * n >= 65536;
    FOR_SHARE(rows, parallel, threads, silu_mul_bf16_range(gate_up, out, n, lo, hi));
#else
    (void)gate_up, (void)out, (void)rows, (void)n, (void)threads;
#endif
}

/* qkv_rope_store for a step that is one prefill chunk: the same norms, rope and K/V writes
 * but the rotated q goes out head-major, q_out [heads, tokens, dim]: the layout torch's SDPA
 * reads fastest (one thread, AMX Xeon, 2,000 tokens: 40.6 ms a layer vs 43.6 ms from the
 * token-major q's transposed view), so no transpose copy is needed either. */
void qkv_rope_store_heads(const void *qkv, void *q_out, void *kv, const int64_t *positions,
                          const int64_t *slot_mapping, const float *cos_table,
                          const float *sin_table, const void *q_norm, const void *k_norm,
                          float eps, int64_t tokens, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t slots, int bf, int threads) {
    rope_store(qkv, q_out, kv, positions, slot_mapping, cos_table, sin_table, q_norm, k_norm,
               eps, tokens, heads, kv_heads, dim, slots, bf, threads, 1);
}

/* ---- Small-batch linear: y = x W^T + bias for a few rows of x, reading the weights as stored.
 * A decode step's matmuls have 1-32 rows: every weight byte is read once per step, so the step
 * is bound by streaming W [out, in] from memory. Each thread takes its own contiguous band of
 * output rows (static schedule), four at a time, and runs them against up to four rows of x
 * (three in AVX2) while those four weight rows sit in L1; with AVX-512 BF16 the dot products
 * are `vdpbf16ps`
 * (pairs of bf16 products summed into float32), elsewhere a float32 loop gcc vectorizes.
 * Accumulation is float32, the result rounded to the model dtype once, as oneDNN's is. */

#define GEMV_ROWS 4 /* output rows per block */
#define GEMV_COLS 4 /* rows of x per pass over a block */

#if defined(HAVE_DPBF16)

/* res[b][r] = dot(x row b, w row r) for nr <= 4 weight rows and nb <= 4 x rows. */
static inline __attribute__((always_inline)) void dot_block_bf16(
    const bf16 *x, int64_t nb, const bf16 *w, int64_t nr, int64_t in, float *res) {
    __m512 acc[GEMV_COLS][GEMV_ROWS];
    for (int b = 0; b < GEMV_COLS; b++)
        for (int r = 0; r < GEMV_ROWS; r++) acc[b][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
        const int64_t left = in - k;
        const __mmask32 m = left >= 32 ? (__mmask32)0xffffffffu : (((__mmask32)1 << left) - 1);
        __m512bh wv[GEMV_ROWS], xv[GEMV_COLS];
        for (int r = 0; r < GEMV_ROWS; r++)
            if (r < nr) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * in + k);
        for (int b = 0; b < GEMV_COLS; b++)
            if (b < nb) xv[b] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + b * in + k);
        for (int b = 0; b < GEMV_COLS; b++)
            for (int r = 0; r < GEMV_ROWS; r++)
                if (b < nb && r < nr) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[r], xv[b]);
    }
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < nr; r++) res[b * GEMV_ROWS + r] = _mm512_reduce_add_ps(acc[b][r]);
}
#endif

#ifdef HAVE_AVX2_BF16
/* AVX2 with FMA and no AVX-512 BF16 (an AVX2-only AMD EPYC): bf16 weights widened to float32 in
 * registers (a bf16 is the high half of a float32) by unpacking 16 at a time with zero, x
 * widened once a call in the same order. The portable loop below widens every weight row into
 * a buffer first and x again per row: it read the small model's weights at ~40% of the host's
 * bandwidth at one row. Unpacking, 3 rows of x a pass (4 before, as two passes of 2) and a
 * copy per whole block: 0.85x the time at 8 and 32 rows (bench/linear_ab.py --march
 * x86-64-v3 --ab-source, the Intel Xeon with AMX kept to AVX2). */

/* x [rows, in] widened to float32 for the AVX2 dot kernels: each whole 16 in the order the
 * weights' unpacks give (widen16_unpacked), the last in % 16 as they are. */
static void widen_x_avx2(const bf16 *x, int64_t rows, int64_t in, float *xf) {
    for (int64_t b = 0; b < rows; b++) {
        int64_t k = 0;
        for (; k + 16 <= in; k += 16) widen16_unpacked(x + b * in + k, xf + b * in + k);
        for (; k < in; k++) xf[b * in + k] = bf16_to_f32(x[b * in + k]);
    }
}

/* res[b * GEMV_ROWS + r] = dot(xf row b, w row r) for nr <= 4 weight rows and nb <= 3 rows of
 * xf (widen_x_avx2's order): each 16 weights unpacked in halves, two weight rows at a time, each
 * 8 of x loaded once for both (12 accumulators, 2 weight registers, a zero and one for x: the 16
 * registers). Inlined with nb and nr constant for a whole block, so nothing branches. */
static inline __attribute__((always_inline)) void dot_block_avx2(
    const float *xf, const int nb, const bf16 *w, const int nr, int64_t in, float *res) {
    __m256 acc[3][GEMV_ROWS];
    for (int b = 0; b < 3; b++)
        for (int r = 0; r < GEMV_ROWS; r++) acc[b][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= in; k += 16)
        for (int half = 0; half < 2; half++)
            for (int r0 = 0; r0 < nr; r0 += 2) {
                const __m256 w0 = unpack16_half(w + r0 * in + k, half);
                const __m256 w1 = r0 + 1 < nr ? unpack16_half(w + (r0 + 1) * in + k, half)
                                              : _mm256_setzero_ps();
                for (int b = 0; b < nb; b++) {
                    const __m256 xv = _mm256_loadu_ps(xf + b * in + k + 8 * half);
                    acc[b][r0] = _mm256_fmadd_ps(w0, xv, acc[b][r0]);
                    if (r0 + 1 < nr) acc[b][r0 + 1] = _mm256_fmadd_ps(w1, xv, acc[b][r0 + 1]);
                }
            }
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < nr; r++) {
            float tail = 0.0f;
            for (int64_t i = k; i < in; i++) tail += bf16_to_f32(w[r * in + i]) * xf[b * in + i];
            res[b * GEMV_ROWS + r] = sum8(acc[b][r]) + tail;
        }
}

/* One row of x against nr weight rows, each row alone from start to end (one stream: a read
 * of 4 rows side by side ran at 0.86x the speed, the small model's 49 weights, 21 rounds of
 * bench/linear_ab.py --ab-source), in four accumulators over steps of 32 (then 16). */
static void dot_one_avx2(const float *xf, const bf16 *w, int64_t nr, int64_t in, float *res) {
    for (int64_t r = 0; r < nr; r++) {
        const bf16 *wr = w + r * in;
        __m256 a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= in; k += 32)
            for (int j = 0; j < 4; j++)
                a[j] = _mm256_fmadd_ps(unpack16_half(wr + k + 16 * (j / 2), j % 2),
                                       _mm256_loadu_ps(xf + k + 8 * j), a[j]);
        if (k + 16 <= in) {
            for (int j = 0; j < 2; j++)
                a[j] = _mm256_fmadd_ps(unpack16_half(wr + k, j), _mm256_loadu_ps(xf + k + 8 * j),
                                       a[j]);
            k += 16;
        }
        float tail = 0.0f;
        for (int64_t i = k; i < in; i++) tail += bf16_to_f32(wr[i]) * xf[i];
        res[r] = sum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))) + tail;
    }
}

/* nb <= 3 rows of xf: one alone (in another order than in a batch), else dot_block_avx2, its
 * own copy for a whole block of weight rows. */
static void dot_block_avx2_any(const float *xf, int64_t nb, const bf16 *w, int64_t nr, int64_t in,
                               float *res) {
    if (nb == 1) dot_one_avx2(xf, w, nr, in, res);
    else if (nr < GEMV_ROWS) dot_block_avx2(xf, (int)nb, w, (int)nr, in, res);
    else if (nb == 2) dot_block_avx2(xf, 2, w, GEMV_ROWS, in, res);
    else dot_block_avx2(xf, 3, w, GEMV_ROWS, in, res);
}
#endif

/* The portable form: float32 math over either dtype. */
static void dot_block_any(const void *x, int64_t nb, const void *w, int64_t nr, int64_t in,
                          int bf, float *res) {
    float wf[in], xf[in];
    for (int64_t r = 0; r < nr; r++) {
        load_f32(w, r * in, in, wf, bf);
        for (int64_t b = 0; b < nb; b++) {
            load_f32(x, b * in, in, xf, bf);
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < in; i++) dot += wf[i] * xf[i];
            res[b * GEMV_ROWS + r] = dot;
        }
    }
}

/* Whether linear_rows takes the AVX-512 BF16 instructions for bf16 (1), AVX2 with FMA (2) or
 * the portable loop (0). */
int linear_rows_isa(void) {
#ifdef HAVE_DPBF16
    return 1;
#elif defined(HAVE_AVX2_BF16)
    return 2;
#else
    return 0;
#endif
}

/* Blocks [lo, hi) of linear_rows' output; xf: x widened to float32, or NULL. */
static void linear_rows_range(const void *x, const void *w, const void *bias, void *y,
                              int64_t rows, int64_t in, int64_t out, int bf, const float *xf,
                              int64_t lo, int64_t hi) {
    const size_t elem = bf ? sizeof(bf16) : sizeof(float);
    (void)xf;
    for (int64_t blk = lo; blk < hi; blk++) {
        const int64_t r0 = blk * GEMV_ROWS;
        const int64_t nr = out - r0 < GEMV_ROWS ? out - r0 : GEMV_ROWS;
        const char *wb = (const char *)w + (size_t)(r0 * in) * elem;
        float bias_f[GEMV_ROWS] = {0};
        if (bias) load_f32(bias, r0, nr, bias_f, bf);
#ifdef HAVE_AVX2_BF16
        const int64_t cols = xf ? 3 : GEMV_COLS; /* AVX2: 3 rows of x by 4 weight rows */
#else
        const int64_t cols = GEMV_COLS;
#endif
        for (int64_t b0 = 0; b0 < rows; b0 += cols) {
            const int64_t nb = rows - b0 < cols ? rows - b0 : cols;
            const char *xb = (const char *)x + (size_t)(b0 * in) * elem;
            float res[GEMV_COLS * GEMV_ROWS];
#ifdef HAVE_DPBF16
            if (bf) {
                /* Full blocks get their own copy with every bound known, so nothing branches. */
                const bf16 *xh = (const bf16 *)xb, *wh = (const bf16 *)wb;
                if (nr < GEMV_ROWS) dot_block_bf16(xh, nb, wh, nr, in, res);
                else if (nb == 1) dot_block_bf16(xh, 1, wh, GEMV_ROWS, in, res);
                else if (nb == 2) dot_block_bf16(xh, 2, wh, GEMV_ROWS, in, res);
                else if (nb == 3) dot_block_bf16(xh, 3, wh, GEMV_ROWS, in, res);
                else dot_block_bf16(xh, GEMV_COLS, wh, GEMV_ROWS, in, res);
            } else
#elif defined(HAVE_AVX2_BF16)
            if (xf)
                dot_block_avx2_any(xf + b0 * in, nb, (const bf16 *)wb, nr, in, res);
            else
#endif
                dot_block_any(xb, nb, wb, nr, in, bf, res);
            for (int64_t b = 0; b < nb; b++) {
                float row[GEMV_ROWS];
                for (int64_t r = 0; r < nr; r++) row[r] = res[b * GEMV_ROWS + r] + bias_f[r];
                store_f32(y, (b0 + b) * out + r0, nr, row, bf);
            }
        }
    }
}

/* y [rows, out] = x [rows, in] @ w [out, in]^T (+ bias [out]), all in the model dtype. */
void linear_rows(const void *x, const void *w, const void *bias, void *y, int64_t rows,
                 int64_t in, int64_t out, int bf, int threads) {
    const int64_t blocks = (out + GEMV_ROWS - 1) / GEMV_ROWS;
    const int parallel = threads > 1 && out * in >= 65536;
    float *xf = NULL;
#ifdef HAVE_AVX2_BF16
    /* x widened once, for every block's FMAs (at most 32 x 2,816 x 4 bytes in the engine; in
     * a step's team once per thread that takes a share) */
    if (bf && (parallel || !step_member || step_member->id == 0)) {
        xf = (float *)malloc((size_t)(rows * in) * sizeof(float));
        if (xf) widen_x_avx2((const bf16 *)x, rows, in, xf);
    }
#endif
    FOR_SHARE(blocks, parallel, threads,
              linear_rows_range(x, w, bias, y, rows, in, out, bf, xf, lo, hi));
    free(xf);
}

/* ---- Thread placement. libgomp keeps one team of worker threads per thread that opens a
 * parallel region, and torch's intra-op regions reuse the engine thread's team, so pinning
 * that team pins every OpenMP region of the engine's steps (vLLM pins its CPU workers the
 * same way). With `bind` 1, thread i of a team of `threads` runs only on cpus[i % n]; with 0,
 * every thread may run on any of cpus[0..n). Returns how many threads were placed. */
/* Whether this build runs its kernels on OpenMP threads (1) or on the caller's thread alone
 * (0: the compiler took no -fopenmp). */
int built_with_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int place_threads(const int32_t *cpus, int n, int threads, int bind) {
    int placed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : placed)
#endif
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        cpu_set_t set;
        CPU_ZERO(&set);
        if (bind) {
            CPU_SET(cpus[t % n], &set);
        } else {
            for (int i = 0; i < n; i++) CPU_SET(cpus[i], &set);
        }
        placed += sched_setaffinity(0, sizeof set, &set) == 0;
    }
    return placed;
}

/* ---- One function on every thread of the calling thread's OpenMP team, at once: share(i, n)
 * on thread i of n. A prefill's matmuls split by rows run their shares this way (each a
 * one-thread oneDNN matmul: a region nested in this one runs on its thread alone), on the
 * team whose other thread would otherwise spin idle beside a second pool's threads for up to
 * libgomp's spin count after every region. Returns n. */
typedef void (*team_share_fn)(int share, int shares);
int run_on_team(team_share_fn share, int threads) {
#ifdef _OPENMP
    int shares = 1;
#pragma omp parallel num_threads(threads)
    {
        const int n = omp_get_num_threads(), i = omp_get_thread_num();
        if (i == 0) shares = n;
        share(i, n);
    }
    return shares;
#else
    (void)threads;
    share(0, 1);
    return 1;
#endif
}

/* ---- Many-row linear on AMX tiles: y [rows, out] = x [rows, in] @ w [out, in]^T (+ bias) in
 * bf16 for the 2-32 rows of a batched decode step. The step is still one stream over the
 * weights, so the weights are read as stored: a tile multiply C[16 x 16] += A[16 x 32] B[32 x
 * 16] takes A = 16 weight rows (32 columns of each, loaded straight from w at its row stride)
 * and B = the same 32 columns of 16 rows of x, which is x transposed into AMX's pair-interleaved
 * layout (B[k / 2][2 n + k % 2] = x[n][k]): x is repacked once per call (it is small), w never.
 * C then holds y^T for 16 output rows and 16 x rows. Each thread takes a band of 32-row weight
 * blocks and runs all of x past a block while it is in L1/L2, so a weight byte comes from
 * memory once whatever the row count, where linear_rows re-reads a block per four x rows
 * (three in AVX2).
 * Linux grants a process the tile registers only on request (arch_prctl); when it refuses,
 * or the CPU or compiler lacks AMX, linear_many_rows runs linear_rows instead. */

#if defined(HAVE_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0: not asked yet, 1: granted, -1: refused. The permission is per process. */
static int amx_state = 0;

static int amx_usable(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

/* Palette 1: tiles 0-3 accumulate C (16 rows of 64 bytes), 4-5 hold A (weight rows), 6-7
 * hold B (x, pair-interleaved). */
struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

static void amx_configure(void) {
    /* a constant, as every tile configuration here (decode_amx_configure says why) */
    static const struct amx_config cfg = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    _tile_loadconfig(&cfg);
}

/* One block of `na` (1 or 2) times 16 weight rows from r0, against x groups [j0, j0 + nj)
 * of 16 rows (nj 1 or 2); results transposed into y with the bias added and rounded once.
 * A tile load of weights touches 16 rows at once, yet the hardware prefetcher keeps up with
 * those 16-32 streams: this pass reads as fast as a plain sum over the same bytes
 * (bench/gemv_micro.c), and an L2 software prefetch of the next block, which it once had, made
 * it 1.18x slower at one row (one prefetch per 64 bytes loaded, for lines already on their
 * way). A tile-blocked weight layout (each A tile 1 KB contiguous) measured no faster. */
static inline __attribute__((always_inline)) void amx_block(const bf16 *w, const bf16 *xp,
                                                            const void *bias, bf16 *y,
                                                            int64_t rows, int64_t in, int64_t out,
                                                            int64_t r0, int na, int64_t j0, int nj) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t wstride = in * (int64_t)sizeof(bf16), pairs = in / 2;
    const bf16 *b0 = xp + j0 * pairs * 32, *b1 = b0 + pairs * 32;
    for (int64_t k = 0; k < in; k += 32) {
        _tile_loadd(4, w + r0 * in + k, wstride);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nj > 1) {
            _tile_loadd(7, b1 + k * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (na > 1) {
            _tile_loadd(5, w + (r0 + 16) * in + k, wstride);
            _tile_dpbf16ps(2, 5, 6);
            if (nj > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float c[16 * 16];
    for (int a = 0; a < na; a++) {
        for (int j = 0; j < nj; j++) {
            const int64_t n0 = (j0 + j) * 16;
            if (n0 >= rows) continue;
            /* tile numbers must be constants */
            if (a == 0 && j == 0) _tile_stored(0, c, 64);
            else if (a == 0) _tile_stored(1, c, 64);
            else if (j == 0) _tile_stored(2, c, 64);
            else _tile_stored(3, c, 64);
            const int64_t rb = r0 + 16 * a, nn = rows - n0 < 16 ? rows - n0 : 16;
            float bias_f[16] = {0};
            if (bias) load_f32(bias, rb, 16, bias_f, 1);
            /* Column n of C is row n0 + n of y: gathered from L1 (a strided scalar copy cost
             * as much as the tile work at 32 rows), rounded to bf16 in one instruction. */
            const __m512i column = _mm512_mullo_epi32(
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                _mm512_set1_epi32(16));
            const __m512 vb = _mm512_loadu_ps(bias_f);
            for (int64_t n = 0; n < nn; n++) {
                const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + n, 4), vb);
                _mm256_storeu_si256((__m256i *)(y + (n0 + n) * out + rb),
                                    (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}
#endif

#ifdef HAVE_AMX
/* ---- Decode attention with the scores on AMX tiles (bf16, head size 64, 1-4 query heads per
 * KV head). In the AVX-512 kernel above, Q·K is half the time once the cache sits in L2: each
 * key and query head takes two `vdpbf16ps` and a share of the 16-to-1 reduction tree. Here the
 * scores of 16 keys for all query heads of the group are two tile multiplies, S^T = K Q^T: A
 * is 16 K rows tile-loaded straight from the cache at their row stride (no repacking), B the
 * group's queries transposed into AMX's pair layout once per call; S^T comes back as 16 rows
 * of 4 floats, turned into one 16-key vector per head by a 4x4 transpose. The softmax and
 * P·V are float32 (P as computed, V converted once per key for all heads), where the AVX-512
 * kernel rounds P to bf16 for vdpbf16ps: the results differ by that rounding and the scores'
 * summation order. */

/* Tiles 0 and 1: S^T (16 keys x 4 heads, float32) of alternate tiles of keys; 4-5: A, 16 K rows,
 * dims 0-31 and 32-63; 6-7: B, the queries' dims 0-31 and 32-63 as 16 pair-rows x 4 heads. */
static void decode_amx_configure(void) {
    /* A constant, not stores into a local (so too the other tile configurations): gcc 12's
     * _tile_loadconfig is an asm whose memory operand is 8 bytes (amxtileintrin.h), so once
     * this was inlined into a larger attention loop (an A/B variant, not kept) the stores of
     * the columns and rows, bytes 16-63, looked dead and were dropped; the first tile load
     * faulted. */
    static const struct amx_config cfg = {
        .palette = 1,
        .colsb = {[0] = 16, [1] = 16, [4] = 64, [5] = 64, [6] = 16, [7] = 16},
        .rows = {[0] = 16, [1] = 16, [4] = 16, [5] = 16, [6] = 16, [7] = 16},
    };
    _tile_loadconfig(&cfg);
}

/* The scores of one tile of n keys from krows into st (16 keys x 4 heads) through tile T; a
 * short tile's rows padded with zeros in kpad, never read past the cache. */
#define AMX_SCORES(T, krows, n, kpad, st)                                                 \
    do {                                                                                 \
        const bf16 *rows_ = (krows);                                                     \
        if ((n) < 16) {                                                                  \
            memcpy((kpad), rows_, (size_t)(n) * 64 * sizeof(bf16));                      \
            memset((kpad) + (n) * 64, 0, (size_t)(16 - (n)) * 64 * sizeof(bf16));        \
            rows_ = (kpad);                                                              \
        }                                                                                \
        _tile_zero(T);                                                                   \
        _tile_loadd(4, rows_, 128);                                                      \
        _tile_loadd(5, rows_ + 32, 128);                                                 \
        _tile_dpbf16ps(T, 4, 6);                                                         \
        _tile_dpbf16ps(T, 5, 7);                                                         \
        _tile_stored(T, (st), 16);                                                       \
    } while (0)

static inline __attribute__((always_inline)) void attend_amx_d64_impl(
    const int G, const bf16 *qb, const void *kv, int64_t kv_heads, int64_t slots, int64_t head,
    const int64_t *table, int64_t block_size, int64_t lo, int64_t hi, float *m, float *l,
    float *acc, float scale) {
    uint32_t qt[2][16][4] __attribute__((aligned(64)));
    bf16 kpad[2][16 * 64] __attribute__((aligned(64)));
    float st[2][16 * 4] __attribute__((aligned(64)));
    memset(qt, 0, sizeof qt);
    for (int g = 0; g < G; g++)
        for (int p = 0; p < 32; p++) qt[p / 16][p % 16][g] = ((const uint32_t *)(qb + g * 64))[p];
    decode_amx_configure();
    _tile_loadd(6, qt[0], 16);
    _tile_loadd(7, qt[1], 16);
    __m512 o[4][4], sum[4];
    float mx[4];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < 4; c++) o[g][c] = _mm512_setzero_ps();
        mx[g] = -INFINITY;
        sum[g] = _mm512_setzero_ps();
    }
    const bf16 *kp = (const bf16 *)kv + head * slots * 64;
    const bf16 *vp = (const bf16 *)kv + (kv_heads + head) * slots * 64;
    const __m512 vscale = _mm512_set1_ps(scale);
    /* lane 4h + k of the result holds lane 4k + h of the source: a 4x4 transpose */
    const __m512i by_head = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    /* One tile ahead: the next tile's scores are asked of the AMX unit before this tile's
     * softmax and P.V, into the other tile and buffer (b), so its K loads and tile multiplies
     * run under this tile's vector work rather than before it, where each tile waited on them
     * (bench/decode_attention_ab.py --ab-source on the Xeon of family 6 model 207: 0.82-0.86x
     * the time at 1,000 and 4,000 keys in L3; from memory with --cold 25, 0.90x at 4,000 keys
     * and 0.88x for batch 32 x 144). So prefetch_tile_after_next's K rows now lead their tile
     * loads by one tile, its V rows their reads by two. */
    int64_t slot = 0, n = 0;
    int b = 0;
    if (lo < hi) {
        slot = tile_at(table, block_size, lo, hi, 16, &n);
        AMX_SCORES(0, kp + slot * 64, n, kpad[0], st[0]);
    }
    for (int64_t pos = lo; pos < hi;) {
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        int64_t nslot = 0, nn = 0;
        if (pos + n < hi) {
            nslot = tile_at(table, block_size, pos + n, hi, 16, &nn);
            if (b) AMX_SCORES(0, kp + nslot * 64, nn, kpad[0], st[0]);
            else AMX_SCORES(1, kp + nslot * 64, nn, kpad[1], st[1]);
        }
        prefetch_tile_after_next(kp, vp, table, block_size, pos, n, hi, slot);
        const float *sc = st[b];
        __m512 y[4], s[4];
        for (int j = 0; j < 4; j++) y[j] = _mm512_permutexvar_ps(by_head, _mm512_load_ps(sc + 16 * j));
        {
            const __m512 t0 = _mm512_shuffle_f32x4(y[0], y[1], 0x44);
            const __m512 t1 = _mm512_shuffle_f32x4(y[0], y[1], 0xEE);
            const __m512 t2 = _mm512_shuffle_f32x4(y[2], y[3], 0x44);
            const __m512 t3 = _mm512_shuffle_f32x4(y[2], y[3], 0xEE);
            s[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
            s[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
            s[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
            s[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
        }
        float p[4][16];
        for (int g = 0; g < G; g++) {
            const __m512 sg = _mm512_mul_ps(s[g], vscale);
            /* one compare finds the usual tile, where no score passes the running max; only a
             * new max pays for the horizontal reduction and the rescale */
            if (_mm512_mask_cmp_ps_mask(valid, sg, _mm512_set1_ps(mx[g]), _CMP_GT_OQ)) {
                const float smax = _mm512_mask_reduce_max_ps(valid, sg);
                const float alpha = mx[g] == -INFINITY ? 0.0f : exp_nonpositive(mx[g] - smax);
                const __m512 va = _mm512_set1_ps(alpha);
                for (int c = 0; c < 4; c++) o[g][c] = _mm512_mul_ps(o[g][c], va);
                sum[g] = _mm512_mul_ps(sum[g], va);
                mx[g] = smax;
            }
            const __m512 e = _mm512_maskz_mov_ps(
                valid, exp16_nonpositive(_mm512_sub_ps(sg, _mm512_set1_ps(mx[g]))));
            sum[g] = _mm512_add_ps(sum[g], e);
            _mm512_storeu_ps(p[g], e);
        }
        for (int64_t t = 0; t < n; t++) {
            const bf16 *vr = vp + (slot + t) * 64;
            const __m512 v0 = bf16x16_to_f32(vr), v1 = bf16x16_to_f32(vr + 16);
            const __m512 v2 = bf16x16_to_f32(vr + 32), v3 = bf16x16_to_f32(vr + 48);
            for (int g = 0; g < G; g++) {
                const __m512 pg = _mm512_set1_ps(p[g][t]);
                o[g][0] = _mm512_fmadd_ps(pg, v0, o[g][0]);
                o[g][1] = _mm512_fmadd_ps(pg, v1, o[g][1]);
                o[g][2] = _mm512_fmadd_ps(pg, v2, o[g][2]);
                o[g][3] = _mm512_fmadd_ps(pg, v3, o[g][3]);
            }
        }
        pos += n;
        slot = nslot;
        n = nn;
        b ^= 1;
    }
    _tile_release();
    for (int g = 0; g < G; g++) {
        m[g] = mx[g];
        l[g] = _mm512_reduce_add_ps(sum[g]);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + c * 16, o[g][c]);
    }
}

static int attend_amx_d64(int64_t group, const bf16 *qb, const void *kv, int64_t kv_heads,
                          int64_t slots, int64_t head, const int64_t *table, int64_t block_size,
                          int64_t lo, int64_t hi, float *m, float *l, float *acc, float scale) {
    if (!amx_usable()) return 0;
#define ATTEND_G(G) attend_amx_d64_impl(G, qb, kv, kv_heads, slots, head, table, block_size, \
                                        lo, hi, m, l, acc, scale)
    switch (group) {
    case 1: ATTEND_G(1); return 1;
    case 2: ATTEND_G(2); return 1;
    case 3: ATTEND_G(3); return 1;
    case 4: ATTEND_G(4); return 1;
    default: return 0;
    }
#undef ATTEND_G
}
#endif

/* Whether linear_many_rows can use AMX tiles here (asking Linux for them on the first call). */
int linear_many_rows_amx(void) {
#ifdef HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
/* One row of x (a batch-1 decode step's matmul): B is x itself, a one-column tile (16 rows of
 * 4 bytes: the pairs x[2i], x[2i + 1] at their place in x), and C one column, y's 16 outputs in
 * order, so there is no copy of x to allocate and repack and no gather of C (the many-row path
 * below pays both per call; measured 1.04x on the small model's one-row pass). Two A tiles, two
 * independent accumulators, per 32-row block. */
static void amx_one_row_range(const bf16 *x, const bf16 *w, const void *bias, bf16 *y,
                              float *yf, int64_t in, int64_t out, int64_t lo, int64_t hi) {
    const int64_t wstride = in * (int64_t)sizeof(bf16);
    {
        /* C: 16 x 1 float, B: 16 pairs x 1 (tiles 0, 2, 6); A: 16 weight rows x 32 bf16 */
        static const struct amx_config cfg = {
            .palette = 1,
            .colsb = {[0] = 4, [2] = 4, [4] = 64, [5] = 64, [6] = 4},
            .rows = {[0] = 16, [2] = 16, [4] = 16, [5] = 16, [6] = 16},
        };
        _tile_loadconfig(&cfg);
        for (int64_t blk = lo; blk < hi; blk++) {
            const int64_t r0 = blk * 32;
            const int na = out - r0 >= 32 ? 2 : 1;
            const bf16 *a = w + r0 * in;
            _tile_zero(0);
            _tile_zero(2);
            if (na == 2) {
                for (int64_t k = 0; k < in; k += 32) {
                    _tile_loadd(6, x + k, 4);
                    _tile_loadd(4, a + k, wstride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(5, a + 16 * in + k, wstride);
                    _tile_dpbf16ps(2, 5, 6);
                }
            } else {
                for (int64_t k = 0; k < in; k += 32) {
                    _tile_loadd(6, x + k, 4);
                    _tile_loadd(4, a + k, wstride);
                    _tile_dpbf16ps(0, 4, 6);
                }
            }
            float c[32];
            _tile_stored(0, c, 4);
            if (na == 2) _tile_stored(2, c + 16, 4);
            for (int h = 0; h < na; h++) {
                __m512 v = _mm512_loadu_ps(c + 16 * h);
                if (bias) v = _mm512_add_ps(v, bf16x16_to_f32((const bf16 *)bias + r0 + 16 * h));
                const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
                if (yf) /* the bf16 result widened, as torch's .float() of y would give it */
                    _mm512_storeu_si512(yf + r0 + 16 * h,
                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
                else
                    _mm256_storeu_si256((__m256i *)(y + r0 + 16 * h), rounded);
            }
        }
        _tile_release();
    }
}

static void amx_one_row(const bf16 *x, const bf16 *w, const void *bias, bf16 *y, float *yf,
                        int64_t in, int64_t out, int threads) {
    const int parallel = threads > 1 && out * in >= 65536;
    FOR_SHARE((out + 31) / 32, parallel, threads,
              amx_one_row_range(x, w, bias, y, yf, in, out, lo, hi));
}
#endif

#ifdef HAVE_AMX
/* linear_many_rows' pair-interleaved copy of x, one per calling thread, grown when a wider
 * or taller x comes and otherwise reused: allocated per call it cost 30-90 us a call at the
 * small model's 2,816-wide inputs (above glibc's mmap threshold each call mapped, faulted in
 * and unmapped fresh pages), against ~10 us for a whole one-row call. Never freed: one buffer
 * per engine thread, the size of the largest x it has multiplied (~1 MB at 32 rows of 14,336). */
static __thread uint32_t *x_pairs_buf;
static __thread size_t x_pairs_cap;

static uint32_t *x_pairs_scratch(size_t n) {
    if (n > x_pairs_cap) {
        free(x_pairs_buf);
        x_pairs_buf = aligned_alloc(64, n * sizeof(uint32_t)); /* n: a multiple of 16 */
        x_pairs_cap = x_pairs_buf ? n : 0;
    }
    return x_pairs_buf;
}
#endif

#ifdef HAVE_AMX
/* 32-row weight blocks [lo, hi) of linear_many_rows' tile path, against x's pair copy xp. */
static void amx_rows_range(const bf16 *w, const uint32_t *xp, const void *bias, bf16 *y,
                           int64_t rows, int64_t in, int64_t out, int64_t groups, int64_t lo,
                           int64_t hi) {
    amx_configure();
    for (int64_t blk = lo; blk < hi; blk++) {
        const int64_t r0 = blk * 32;
        const int na = out - r0 >= 32 ? 2 : 1;
        for (int64_t j0 = 0; j0 < groups; j0 += 2) {
            const int nj = groups - j0 >= 2 ? 2 : 1;
            amx_block(w, (const bf16 *)xp, bias, y, rows, in, out, r0, na, j0, nj);
        }
    }
    _tile_release();
}
#endif

/* y [rows, out] = x [rows, in] @ w [out, in]^T (+ bias [out]) for a few dozen rows: AMX tiles
 * for bf16 where the CPU, compiler and kernel allow and the shapes fit (in a multiple of 32,
 * out of 16), linear_rows otherwise. Returns 1 when it took the tiles, 0 when not, -1 when
 * its scratch memory could not be allocated. */
int linear_many_rows(const void *x, const void *w, const void *bias, void *y, int64_t rows,
                     int64_t in, int64_t out, int bf, int threads) {
#ifdef HAVE_AMX
    if (bf && rows == 1 && in % 32 == 0 && out % 16 == 0 && amx_usable()) {
        amx_one_row((const bf16 *)x, (const bf16 *)w, bias, (bf16 *)y, NULL, in, out, threads);
        return 1;
    }
    if (bf && rows > 0 && in % 32 == 0 && out % 16 == 0 && amx_usable()) {
        const int64_t groups = (rows + 15) / 16, pairs = in / 2;
        const int parallel = threads > 1 && out * in >= 65536;
        /* in a step's team a copy per thread that takes a share (thread 0 alone if serial) */
        const int idle = step_member && !parallel && step_member->id != 0;
        uint32_t *xp = idle ? NULL : x_pairs_scratch((size_t)(groups * pairs * 16));
        if (idle) {
            FOR_SHARE((int64_t)0, parallel, threads, (void)lo);
            return 1;
        }
        if (!xp) {
            if (!step_member) return -1;
            /* the team's other threads go on to this kernel's barrier: meet them there */
            __atomic_store_n(&step_member->state->failed, 1, __ATOMIC_RELAXED);
            FOR_SHARE((int64_t)0, parallel, threads, (void)lo);
            return 1;
        }
        const uint32_t *x32 = (const uint32_t *)x;
        for (int64_t j = 0; j < groups; j++) { /* 64 contiguous bytes written per pair index */
            const int64_t live = rows - j * 16 < 16 ? rows - j * 16 : 16;
            const uint32_t *src = x32 + j * 16 * pairs;
            uint32_t *dst = xp + j * pairs * 16;
            for (int64_t kk = 0; kk < pairs; kk++) {
                for (int64_t n = 0; n < live; n++) dst[kk * 16 + n] = src[n * pairs + kk];
                for (int64_t n = live; n < 16; n++) dst[kk * 16 + n] = 0;
            }
        }
        FOR_SHARE((out + 31) / 32, parallel, threads,
                  amx_rows_range((const bf16 *)w, xp, bias, (bf16 *)y, rows, in, out, groups,
                                 lo, hi));
        return 1;
    }
#endif
    linear_rows(x, w, bias, y, rows, in, out, bf, threads);
    return 0;
}

/* ---- Prefill attention on AMX tiles: causal attention of one chunk's queries, at positions
 * cached..cached+n-1, over its context's keys 0..cached+n-1, bf16 in and out.
 * torch's flash kernel runs these scores and values at ~0.18 TFLOP/s of one core (AMX Xeon,
 * 2,000 tokens) where oneDNN's matmuls reach ~0.85; here both products are tile multiplies
 * (C[16 x 16] f32 += A[16 x 32] bf16 . B[32 x 16] bf16) and the softmax is AVX-512 between them.
 *
 * Layout: q [n, heads, dim] at any token and head strides (the C path's head-major q or a
 * token-major slice); keys and values [kv_heads, total, dim] at any head stride (the chunk's
 * gathered cache rows); out [n, heads, dim] contiguous, as o_proj reads it. dim a multiple of
 * 32, up to 256.
 * Each call first repacks K and V per KV head into the tiles' B layout (pairs of bf16 along the
 * reduced dimension interleaved): K per 16 keys [dim / 2][16] (so S = Q K^T needs no transpose)
 * and V per 32 keys and 16 columns [16 key pairs][32]. Padding keys are zero.
 * Work is (KV head, block of 16 query rows), head-major: a thread takes one KV head's query
 * blocks in turn, so that head's packed K/V (512 KB at 2,000 keys and head size 64) stays in
 * L2 across them, where cycling through the heads swept all of them (2 MB, the whole L2) per
 * few items; within a head, largest block first (a later query block sees more keys). Each
 * item runs the query heads of its GQA group, two at a time so that every K and V tile loaded
 * serves both, through one chunk of up to 512 keys before the next. Per head and chunk: scores
 * into f32, the causal mask on the chunk's last keys, an online softmax (running max m and sum
 * l per row, the row's earlier output rescaled by exp(m_old - m_new)), P rounded to bf16 for
 * P . V, l summed in float32 before that rounding (as torch's flash kernel does).
 * Linux grants a process the tile registers only on request (arch_prctl); when it refuses, or
 * the CPU or compiler lacks AMX, the entry point returns 0 and the caller keeps SDPA.
 */

#ifdef HAVE_DPBF16 /* AMX's permission request and tile config are linear_many_rows' (above) */
#define PREFILL_KEYS 512 /* keys per online-softmax chunk */
#define PREFILL_MAX_DIM 256
#define PREFILL_MAX_GROUP 16
#ifdef HAVE_AMX

/* Tile numbers must be compile-time constants: store accumulator t (0-3). */
static inline __attribute__((always_inline)) void prefill_store_acc(int t, float *dst,
                                                                    int64_t stride_bytes) {
    if (t == 0) _tile_stored(0, dst, stride_bytes);
    else if (t == 1) _tile_stored(1, dst, stride_bytes);
    else if (t == 2) _tile_stored(2, dst, stride_bytes);
    else _tile_stored(3, dst, stride_bytes);
}

/* S [16, kc] (row stride PREFILL_KEYS) = Qb [16, dim] . K^T for the kc keys (a multiple of 32)
 * of packed blocks from kb0 (16 keys each, [dim / 2][16] pairs). */
static inline void prefill_scores(const bf16 *qb, const uint32_t *kp, int64_t kb0, int64_t kc,
                                  int64_t dim, float *s) {
    const int64_t pairs = dim / 2, qstride = dim * (int64_t)sizeof(bf16);
    for (int64_t kk = 0; kk < kc; kk += 64) {
        const int four = kc - kk >= 64;
        const uint32_t *b = kp + (kb0 + kk / 16) * pairs * 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < dim / 32; c++) {
            _tile_loadd(4, qb + c * 32, qstride);
            _tile_loadd(5, b + c * 256, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + pairs * 16 + c * 256, 64);
            _tile_dpbf16ps(1, 4, 6);
            if (four) {
                _tile_loadd(5, b + 2 * pairs * 16 + c * 256, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, b + 3 * pairs * 16 + c * 256, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        const int64_t sstride = PREFILL_KEYS * (int64_t)sizeof(float);
        _tile_stored(0, s + kk, sstride);
        _tile_stored(1, s + kk + 16, sstride);
        if (four) {
            _tile_stored(2, s + kk + 32, sstride);
            _tile_stored(3, s + kk + 48, sstride);
        }
    }
}

/* pv [16, dim] = P [16, kc] (bf16, row stride PREFILL_KEYS) . V for the kc keys (a multiple of
 * 32) of packed 32-key blocks from vb0 ([dim / 16][16 key pairs][32] each). */
static inline void prefill_values(const bf16 *p, const bf16 *vp, int64_t vb0, int64_t kc,
                                  int64_t dim, float *pv) {
    const int64_t cols = dim / 16, block = cols * 16 * 32;
    const int64_t pstride = PREFILL_KEYS * (int64_t)sizeof(bf16);
    const int64_t ostride = dim * (int64_t)sizeof(float);
    for (int64_t d0 = 0; d0 < cols; d0 += 4) {
        const int nd = cols - d0 >= 4 ? 4 : (int)(cols - d0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k32 = 0; k32 < kc / 32; k32++) {
            const bf16 *b = vp + (vb0 + k32) * block + d0 * 512;
            _tile_loadd(4, p + k32 * 32, pstride);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nd > 1) {
                _tile_loadd(6, b + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nd > 2) {
                _tile_loadd(5, b + 1024, 64);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (nd > 3) {
                _tile_loadd(6, b + 1536, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        for (int t = 0; t < nd; t++) prefill_store_acc(t, pv + (d0 + t) * 16, ostride);
    }
}

/* Two query heads of one GQA group at once: Sa, Sb [16, kc] (row stride PREFILL_KEYS) from
 * Qa, Qb [16, dim] against the same keys, so each K tile loaded (from L2: a chunk's packed K is
 * 64 KB at head size 64) serves two heads' products instead of one. */
static inline void prefill_scores2(const bf16 *qa, const bf16 *qb, const uint32_t *kp,
                                   int64_t kb0, int64_t kc, int64_t dim, float *sa, float *sb) {
    const int64_t pairs = dim / 2, qstride = dim * (int64_t)sizeof(bf16);
    const int64_t sstride = PREFILL_KEYS * (int64_t)sizeof(float);
    for (int64_t kk = 0; kk < kc; kk += 32) {
        const uint32_t *b = kp + (kb0 + kk / 16) * pairs * 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < dim / 32; c++) {
            _tile_loadd(5, b + c * 256, 64);
            _tile_loadd(6, b + pairs * 16 + c * 256, 64);
            _tile_loadd(4, qa + c * 32, qstride);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, qb + c * 32, qstride);
            _tile_dpbf16ps(2, 7, 5);
            _tile_dpbf16ps(3, 7, 6);
        }
        _tile_stored(0, sa + kk, sstride);
        _tile_stored(1, sa + kk + 16, sstride);
        _tile_stored(2, sb + kk, sstride);
        _tile_stored(3, sb + kk + 16, sstride);
    }
}

/* pva, pvb [16, dim] = Pa, Pb [16, kc] . V: two heads of a GQA group against the same values,
 * each V tile loaded once for both (see prefill_scores2). dim is a multiple of 32. */
static inline void prefill_values2(const bf16 *pa, const bf16 *pb, const bf16 *vp, int64_t vb0,
                                   int64_t kc, int64_t dim, float *pva, float *pvb) {
    const int64_t cols = dim / 16, block = cols * 16 * 32;
    const int64_t pstride = PREFILL_KEYS * (int64_t)sizeof(bf16);
    const int64_t ostride = dim * (int64_t)sizeof(float);
    for (int64_t d0 = 0; d0 < cols; d0 += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k32 = 0; k32 < kc / 32; k32++) {
            const bf16 *b = vp + (vb0 + k32) * block + d0 * 512;
            _tile_loadd(5, b, 64);
            _tile_loadd(6, b + 512, 64);
            _tile_loadd(4, pa + k32 * 32, pstride);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, pb + k32 * 32, pstride);
            _tile_dpbf16ps(2, 7, 5);
            _tile_dpbf16ps(3, 7, 6);
        }
        _tile_stored(0, pva + d0 * 16, ostride);
        _tile_stored(1, pva + (d0 + 1) * 16, ostride);
        _tile_stored(2, pvb + d0 * 16, ostride);
        _tile_stored(3, pvb + (d0 + 1) * 16, ostride);
    }
}
#endif /* HAVE_AMX */

/* The same four products in AVX-512 BF16 for CPUs without AMX tiles (prefill_attention_vec),
 * on the same packed layouts: a packed K block's pair k is one vector of 16 keys, a packed V
 * block's key pair one vector of 16 columns, so each `vdpbf16ps` against a query's (or a
 * weight row's) pair, broadcast, adds 16 keys' (columns') worth. 4 rows x 4 vectors of
 * accumulators: each vector loaded serves 4 rows, each broadcast 4 vectors. */
static inline __attribute__((always_inline)) void prefill_scores_vec4(
    const bf16 *qb, const uint32_t *b, int64_t dim, int nb, float *s) {
    const int64_t pairs = dim / 2;
    for (int r0 = 0; r0 < 16; r0 += 4) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < pairs; k++) {
            __m512bh kv[4];
            for (int j = 0; j < nb; j++)
                kv[j] = (__m512bh)_mm512_loadu_si512((const void *)(b + (j * pairs + k) * 16));
            for (int r = 0; r < 4; r++) {
                const __m512bh qp = pair_of(qb + (r0 + r) * dim, k);
                for (int j = 0; j < nb; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qp, kv[j]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < nb; j++)
                _mm512_storeu_ps(s + (r0 + r) * PREFILL_KEYS + 16 * j, acc[r][j]);
    }
}

static inline void prefill_scores_vec(const bf16 *qb, const uint32_t *kp, int64_t kb0,
                                      int64_t kc, int64_t dim, float *s) {
    const int64_t pairs = dim / 2;
    for (int64_t kk = 0; kk < kc; kk += 64) {
        const uint32_t *b = kp + (kb0 + kk / 16) * pairs * 16;
        if (kc - kk >= 64) prefill_scores_vec4(qb, b, dim, 4, s + kk);
        else prefill_scores_vec4(qb, b, dim, 2, s + kk); /* kc is a multiple of 32 */
    }
}

static inline __attribute__((always_inline)) void prefill_values_vec4(
    const bf16 *p, const bf16 *vp, int64_t vb0, int64_t kc, int64_t dim, int64_t c0, int nc,
    float *pv) {
    const int64_t block = dim / 16 * 16 * 32;
    for (int r0 = 0; r0 < 16; r0 += 4) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int64_t k32 = 0; k32 < kc / 32; k32++) {
            const bf16 *b = vp + (vb0 + k32) * block + c0 * 512;
            const bf16 *pk = p + k32 * 32;
            for (int64_t kp2 = 0; kp2 < 16; kp2++) {
                __m512bh vv[4];
                for (int j = 0; j < nc; j++)
                    vv[j] = (__m512bh)_mm512_loadu_si512((const void *)(b + j * 512 + kp2 * 32));
                for (int r = 0; r < 4; r++) {
                    const __m512bh pp = pair_of(pk + (r0 + r) * PREFILL_KEYS, kp2);
                    for (int j = 0; j < nc; j++)
                        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pp, vv[j]);
                }
            }
        }
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < nc; j++)
                _mm512_storeu_ps(pv + (r0 + r) * dim + (c0 + j) * 16, acc[r][j]);
    }
}

static inline void prefill_values_vec(const bf16 *p, const bf16 *vp, int64_t vb0, int64_t kc,
                                      int64_t dim, float *pv) {
    const int64_t cols = dim / 16;
    for (int64_t c0 = 0; c0 < cols; c0 += 4) {
        if (cols - c0 >= 4) prefill_values_vec4(p, vp, vb0, kc, dim, c0, 4, pv);
        else prefill_values_vec4(p, vp, vb0, kc, dim, c0, 2, pv); /* dim a multiple of 32 */
    }
}

/* 2^t on 16 lanes for the softmax's t <= 0 (finite): 2^floor(t) * 2^f with f = t - floor(t)
 * in [0, 1) from one vreduceps, 2^f by a degree-3 polynomial fitted for relative error on
 * [0, 1) (p(0) = 1 exactly, so the row's max weighs exactly 1; error < 9e-5, 1/40 of the bf16
 * rounding P gets) and 2^floor(t) by vscalefps, which floors its exponent operand itself and
 * underflows to 0 for very negative t. Five instructions where rounding to the nearest
 * integer, subtracting it and a degree-4 Taylor polynomial on [-1/2, 1/2] took seven (error
 * 6e-5; the outputs' error against float64 is the same, docs/performance.md). */
static inline __m512 prefill_exp2_16(__m512 t) {
    /* imm 0x09: keep 0 fraction bits, round down, exceptions suppressed */
    const __m512 f = _mm512_reduce_ps(t, 0x09);
    __m512 p = _mm512_set1_ps(0.07706601917743683f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2276461124420166f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6951165199279785f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, t);
}

/* One row's softmax step over its chunk scores s[0, kc): the first `vis` are visible (the rest
 * masked or padding). m is the row's running max in units of log2 (scores times
 * c = scale * log2 e), so each weight is one fmsub and one 2^t; updates m and the running sum
 * l, writes P (bf16, zeros past vis) and returns the factor the row's earlier output is
 * rescaled by. */
static inline float prefill_softmax_row(const float *s, int64_t kc, int64_t vis, float c,
                                        float *m, float *l, bf16 *p) {
    if (vis <= 0) {
        memset(p, 0, (size_t)kc * sizeof(bf16));
        return 1.0f;
    }
    /* full vectors unmasked, then one masked tail: a mask per vector would take the same
     * ports as the vector math. Four maxima and four sums, so that the loops are not one chain
     * of dependent max or add latencies (4 cycles each) per vector. */
    const int64_t full = vis & ~(int64_t)15, full4 = vis & ~(int64_t)63;
    __m512 mx0 = _mm512_set1_ps(-INFINITY), mx1 = mx0, mx2 = mx0, mx3 = mx0;
    int64_t j = 0;
    for (; j < full4; j += 64) {
        mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(s + j));
        mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(s + j + 16));
        mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(s + j + 32));
        mx3 = _mm512_max_ps(mx3, _mm512_loadu_ps(s + j + 48));
    }
    for (; j < full; j += 16) mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(s + j));
    if (full < vis) {
        const __mmask16 k = tail16(vis - full);
        mx1 = _mm512_mask_max_ps(mx1, k, mx1, _mm512_maskz_loadu_ps(k, s + full));
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx0, mx1), _mm512_max_ps(mx2, mx3));
    const float m_new = fmaxf(*m, _mm512_reduce_max_ps(mx) * c);
    const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(m_new);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0, sum2 = sum0, sum3 = sum0;
#define PREFILL_EXP_AT(o, acc)                                                                     \
    do {                                                                                           \
        const __m512 e = prefill_exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + (o)), cv, mv));   \
        _mm256_storeu_si256((__m256i *)(p + j + (o)), (__m256i)_mm512_cvtneps_pbh(e));             \
        acc = _mm512_add_ps(acc, e);                                                               \
    } while (0)
    for (j = 0; j < full4; j += 64) {
        PREFILL_EXP_AT(0, sum0);
        PREFILL_EXP_AT(16, sum1);
        PREFILL_EXP_AT(32, sum2);
        PREFILL_EXP_AT(48, sum3);
    }
    for (; j < full; j += 16) PREFILL_EXP_AT(0, sum0);
#undef PREFILL_EXP_AT
    for (j = full; j < kc; j += 16) {
        const __mmask16 k = j < vis ? tail16(vis - j) : 0;
        __m512 e = prefill_exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), cv, mv));
        e = _mm512_maskz_mov_ps(k, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
        sum1 = _mm512_add_ps(sum1, e);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(sum0, sum1), _mm512_add_ps(sum2, sum3));
    /* exp2(d) = exp(d ln 2) for d <= 0 */
    const float alpha = *m == -INFINITY ? 0.0f : exp_neg_abs((*m - m_new) * 0.6931471805599453f);
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

/* The softmax step of one head's 16 query rows (from q0, `rows` real) over the chunk of kc
 * keys from k0 (scores s, P into p); alpha gets each row's rescale factor. */
static inline void prefill_softmax_block(const float *s, bf16 *p, int64_t rows, int64_t first,
                                         int64_t kend, int64_t k0, int64_t kc, float c2,
                                         float *m, float *l, float *alpha) {
    for (int64_t r = 0; r < 16; r++) {
        /* row r sees keys through its own position (first + r); padding rows see the
         * block's keys (finite, never written out) */
        const int64_t last = r < rows ? first + r : kend - 1;
        int64_t vis = last + 1 - k0;
        if (vis > kc) vis = kc;
        alpha[r] = prefill_softmax_row(s + r * PREFILL_KEYS, kc, vis, c2, m + r, l + r,
                                       p + r * PREFILL_KEYS);
    }
}

/* o = o * alpha (per row) + pv for one head's 16 rows of f32 output. */
static inline void prefill_rescale(float *o, const float *pv, const float *alpha, int64_t dim) {
    for (int64_t r = 0; r < 16; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 acc = _mm512_loadu_ps(o + r * dim + d);
            _mm512_storeu_ps(o + r * dim + d,
                             _mm512_fmadd_ps(acc, a, _mm512_loadu_ps(pv + r * dim + d)));
        }
    }
}

/* Rows of `dim` where consecutive keys of a head live from key `first` on: at row `key`, or,
 * with a block table (paged cache), at slot blocks[key / block_size] * block_size + key %
 * block_size, with one division a tile rather than one a key. */
static inline void prefill_key_rows(int64_t first, int64_t count, const int64_t *blocks,
                                    int64_t block_size, int64_t *rows) {
    if (!blocks) {
        for (int64_t i = 0; i < count; i++) rows[i] = first + i;
        return;
    }
    int64_t b = first / block_size, off = first % block_size;
    for (int64_t i = 0; i < count; i++) {
        rows[i] = blocks[b] * block_size + off;
        if (++off == block_size) b++, off = 0;
    }
}

/* K and V of one KV head into the tiles' layouts (see above); keys past `total` are zero.
 * `blocks` (or NULL) maps keys to cache slots, see prefill_key_rows. */
static void prefill_pack_kv(const bf16 *k, const bf16 *v, int64_t total, int64_t dim,
                            uint32_t *kp, bf16 *vp, int64_t kb, const int64_t *blocks,
                            int64_t block_size) {
    const int64_t pairs = dim / 2, cols = dim / 16;
    /* K: the 16 keys of block kb */
    uint32_t *kdst = kp + kb * pairs * 16;
    int64_t rows[32];
    const int64_t kleft = total - kb * 16;
    prefill_key_rows(kb * 16, kleft < 16 ? (kleft > 0 ? kleft : 0) : 16, blocks, block_size, rows);
    for (int64_t n = 0; n < 16; n++) {
        const int64_t key = kb * 16 + n;
        if (key >= total) {
            for (int64_t pp = 0; pp < pairs; pp++) kdst[pp * 16 + n] = 0;
            continue;
        }
        const uint32_t *src = (const uint32_t *)(k + rows[n] * dim);
        for (int64_t pp = 0; pp < pairs; pp++) kdst[pp * 16 + n] = src[pp];
    }
    /* V: one 32-key block per two K blocks */
    if (kb % 2) return;
    const int64_t vb = kb / 2;
    bf16 *vdst = vp + vb * cols * 512;
    const int64_t vleft = total - vb * 32;
    prefill_key_rows(vb * 32, vleft < 32 ? (vleft > 0 ? vleft : 0) : 32, blocks, block_size, rows);
    for (int64_t kk = 0; kk < 32; kk++) {
        const int64_t key = vb * 32 + kk;
        const bf16 *src = key < total ? v + rows[kk] * dim : v;
        for (int64_t d = 0; d < dim; d++)
            vdst[(d / 16) * 512 + (kk / 2) * 32 + (d % 16) * 2 + kk % 2] = key < total ? src[d] : 0;
    }
}
#endif

/* Whether prefill_attention_vec can run here (the build has AVX-512 BF16). */
int prefill_attention_vec_usable(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}

/* Whether prefill_attention_amx can run here (asking Linux for the tiles on the first call). */
int prefill_attention_amx_usable(void) {
#ifdef HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

/* The attention described above. Strides in elements. Returns 1 when done, 0 when it cannot
 * run here (tiles asked where AMX is not granted, or shapes outside its limits; nothing
 * written), -1 when its scratch memory could not be allocated. */
#ifdef HAVE_DPBF16
/* tiles: the products on AMX tiles (1) or in AVX-512 BF16 (0). */
static int prefill_attention_core(int tiles, const bf16 *q, const bf16 *keys, const bf16 *values,
                                      bf16 *out, int64_t n, int64_t cached, int64_t heads,
                                      int64_t kv_heads, int64_t dim, int64_t q_tok_stride,
                                      int64_t q_head_stride, int64_t kv_head_stride, float scale,
                                      int threads, const int64_t *blocks, int64_t block_size) {
    const int64_t total = cached + n;
    if (n <= 0 || kv_heads <= 0 || heads % kv_heads || dim % 32 || dim > PREFILL_MAX_DIM ||
        heads / kv_heads > PREFILL_MAX_GROUP)
        return 0;
#ifdef HAVE_AMX
    if (tiles && !amx_usable()) return 0;
#else
    if (tiles) return 0;
#endif
    const int64_t group = heads / kv_heads, padded = (total + 31) / 32 * 32;
    const float c2 = scale * 1.44269504088896341f; /* scores to log2 units */
    const int64_t kblocks = padded / 16, qblocks = (n + 15) / 16;
    const int64_t head_pack = padded * dim; /* elements of bf16 (or half as many uint32) */
    if (threads < 1) threads = 1;
    /* per thread: S f32 [2][16][KEYS], P bf16 [2][16][KEYS], pv f32 [2][16][dim] (two heads at
     * a time), O f32 [group][16][dim], Qb bf16 [group][16][dim], m and l f32 [group][16] */
    const size_t per_thread = (size_t)(2 * 16 * PREFILL_KEYS * 4 + 2 * 16 * PREFILL_KEYS * 2 +
                                       2 * 16 * dim * 4 + group * 16 * dim * 4 +
                                       group * 16 * dim * 2 + group * 16 * 8 + 63) /
                              64 * 64;
    uint32_t *kp = aligned_alloc(64, (size_t)(kv_heads * head_pack) * sizeof(bf16));
    bf16 *vp = aligned_alloc(64, (size_t)(kv_heads * head_pack) * sizeof(bf16));
    char *scratch = aligned_alloc(64, per_thread * (size_t)threads);
    if (!kp || !vp || !scratch) {
        free(kp);
        free(vp);
        free(scratch);
        return -1;
    }
    const int parallel = threads > 1 && n * heads * dim >= 65536;
#pragma omp parallel num_threads(threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < kv_heads * kblocks; i++) {
            const int64_t h = i / kblocks, kb = i % kblocks;
            prefill_pack_kv(keys + h * kv_head_stride, values + h * kv_head_stride, total, dim,
                            kp + h * (head_pack / 2), vp + h * head_pack, kb, blocks, block_size);
        }
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        char *mine = scratch + per_thread * (size_t)me;
        float *s = (float *)mine;
        bf16 *p = (bf16 *)(s + 2 * 16 * PREFILL_KEYS);
        float *pv = (float *)(p + 2 * 16 * PREFILL_KEYS);
        float *o = pv + 2 * 16 * dim;
        float *m = o + group * 16 * dim, *l = m + group * 16;
        bf16 *qb = (bf16 *)(l + group * 16);
#ifdef HAVE_AMX
        if (tiles) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < kv_heads * qblocks; item++) {
            const int64_t qblk = qblocks - 1 - item % qblocks, h = item / qblocks;
            const int64_t q0 = qblk * 16, rows = n - q0 < 16 ? n - q0 : 16;
            /* keys any row of the block sees: through the last row's own position */
            const int64_t kend = cached + q0 + rows;
            for (int64_t g = 0; g < group; g++) {
                const int64_t hq = h * group + g;
                bf16 *qg = qb + g * 16 * dim;
                for (int64_t r = 0; r < 16; r++) {
                    if (r < rows)
                        memcpy(qg + r * dim, q + (q0 + r) * q_tok_stride + hq * q_head_stride,
                               (size_t)dim * sizeof(bf16));
                    else
                        memset(qg + r * dim, 0, (size_t)dim * sizeof(bf16));
                    m[g * 16 + r] = -INFINITY;
                    l[g * 16 + r] = 0.0f;
                }
                memset(o + g * 16 * dim, 0, (size_t)(16 * dim) * sizeof(float));
            }
            for (int64_t k0 = 0; k0 < kend; k0 += PREFILL_KEYS) {
                const int64_t left = kend - k0;
                const int64_t span = left < PREFILL_KEYS ? left : PREFILL_KEYS;
                const int64_t kc = (span + 31) & ~(int64_t)31;
                const uint32_t *kh = kp + h * (head_pack / 2);
                const bf16 *vh = vp + h * head_pack;
                const int64_t first = cached + q0;
                float alpha[2][16];
                int64_t g = 0;
                for (; g + 1 < group; g += 2) { /* heads in pairs: one K/V tile load for two */
                    float *sb = s + 16 * PREFILL_KEYS, *pvb = pv + 16 * dim;
                    bf16 *pb = p + 16 * PREFILL_KEYS;
#ifdef HAVE_AMX
                    if (tiles)
                        prefill_scores2(qb + g * 16 * dim, qb + (g + 1) * 16 * dim, kh, k0 / 16,
                                        kc, dim, s, sb);
                    else
#endif
                    {
                        prefill_scores_vec(qb + g * 16 * dim, kh, k0 / 16, kc, dim, s);
                        prefill_scores_vec(qb + (g + 1) * 16 * dim, kh, k0 / 16, kc, dim, sb);
                    }
                    prefill_softmax_block(s, p, rows, first, kend, k0, kc, c2, m + g * 16,
                                          l + g * 16, alpha[0]);
                    prefill_softmax_block(sb, pb, rows, first, kend, k0, kc, c2,
                                          m + (g + 1) * 16, l + (g + 1) * 16, alpha[1]);
#ifdef HAVE_AMX
                    if (tiles) prefill_values2(p, pb, vh, k0 / 32, kc, dim, pv, pvb);
                    else
#endif
                    {
                        prefill_values_vec(p, vh, k0 / 32, kc, dim, pv);
                        prefill_values_vec(pb, vh, k0 / 32, kc, dim, pvb);
                    }
                    prefill_rescale(o + g * 16 * dim, pv, alpha[0], dim);
                    prefill_rescale(o + (g + 1) * 16 * dim, pvb, alpha[1], dim);
                }
                if (g < group) { /* an odd group's last head alone */
#ifdef HAVE_AMX
                    if (tiles) prefill_scores(qb + g * 16 * dim, kh, k0 / 16, kc, dim, s);
                    else
#endif
                        prefill_scores_vec(qb + g * 16 * dim, kh, k0 / 16, kc, dim, s);
                    prefill_softmax_block(s, p, rows, first, kend, k0, kc, c2, m + g * 16,
                                          l + g * 16, alpha[0]);
#ifdef HAVE_AMX
                    if (tiles) prefill_values(p, vh, k0 / 32, kc, dim, pv);
                    else
#endif
                        prefill_values_vec(p, vh, k0 / 32, kc, dim, pv);
                    prefill_rescale(o + g * 16 * dim, pv, alpha[0], dim);
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t hq = h * group + g;
                for (int64_t r = 0; r < rows; r++) {
                    const __m512 inv = _mm512_set1_ps(1.0f / l[g * 16 + r]);
                    const float *src = o + (g * 16 + r) * dim;
                    bf16 *dst = out + ((q0 + r) * heads + hq) * dim;
                    for (int64_t d = 0; d < dim; d += 16)
                        store16_bf16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(src + d), inv),
                                     0xffff);
                }
            }
        }
#ifdef HAVE_AMX
        if (tiles) _tile_release();
#endif
    }
    free(kp);
    free(vp);
    free(scratch);
    return 1;
}
#endif

/* The entry points below: the kernel with its products on AMX tiles (tiles) or in AVX-512
 * BF16, over keys and values [kv_heads, *, dim] at kv_head_stride, read through `blocks` where
 * set (see prefill_key_rows). 1 when done, 0 when it cannot run here (the build or CPU lacks
 * the products asked for, or the shape is outside the limits; nothing written), -1 when its
 * scratch memory could not be allocated. */
static int prefill_entry(int tiles, const bf16 *q, const bf16 *keys, const bf16 *values,
                         bf16 *out, int64_t n, int64_t cached, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t q_tok_stride, int64_t q_head_stride,
                         int64_t kv_head_stride, float scale, int threads,
                         const int64_t *blocks, int64_t block_size) {
#ifdef HAVE_DPBF16
    if (block_size < 1) return 0;
    return prefill_attention_core(tiles, q, keys, values, out, n, cached, heads, kv_heads, dim,
                                  q_tok_stride, q_head_stride, kv_head_stride, scale, threads,
                                  blocks, block_size);
#else
    (void)tiles, (void)q, (void)keys, (void)values, (void)out, (void)n, (void)cached;
    (void)heads, (void)kv_heads, (void)dim, (void)q_tok_stride, (void)q_head_stride;
    (void)kv_head_stride, (void)scale, (void)threads, (void)blocks, (void)block_size;
    return 0;
#endif
}

int prefill_attention_amx(const bf16 *q, const bf16 *keys, const bf16 *values, bf16 *out,
                          int64_t n, int64_t cached, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t q_tok_stride, int64_t q_head_stride, int64_t kv_head_stride,
                          float scale, int threads) {
    return prefill_entry(1, q, keys, values, out, n, cached, heads, kv_heads, dim, q_tok_stride,
                         q_head_stride, kv_head_stride, scale, threads, NULL, 1);
}

/* The same attention with keys and values read where they lie in a layer's paged cache
 * [2, kv_heads, slots, dim] (K planes, then V planes): key i of the chunk's context at slot
 * blocks[i / block_size] * block_size + i % block_size. Packing K/V for the tiles is already
 * one pass over them, so reading them through the block table there saves the engine's
 * gather copy (a pass over the context's K/V and one more parallel region a layer). */
int prefill_attention_amx_paged(const bf16 *q, const bf16 *cache, bf16 *out, int64_t n,
                                int64_t cached, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t q_tok_stride, int64_t q_head_stride, int64_t slots,
                                const int64_t *blocks, int64_t block_size, float scale,
                                int threads) {
    return prefill_entry(1, q, cache, cache + kv_heads * slots * dim, out, n, cached, heads,
                         kv_heads, dim, q_tok_stride, q_head_stride, slots * dim, scale, threads,
                         blocks, block_size);
}

/* The same two with the products in AVX-512 BF16 (no AMX tiles needed). */
int prefill_attention_vec(const bf16 *q, const bf16 *keys, const bf16 *values, bf16 *out,
                          int64_t n, int64_t cached, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t q_tok_stride, int64_t q_head_stride, int64_t kv_head_stride,
                          float scale, int threads) {
    return prefill_entry(0, q, keys, values, out, n, cached, heads, kv_heads, dim, q_tok_stride,
                         q_head_stride, kv_head_stride, scale, threads, NULL, 1);
}

int prefill_attention_vec_paged(const bf16 *q, const bf16 *cache, bf16 *out, int64_t n,
                                int64_t cached, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t q_tok_stride, int64_t q_head_stride, int64_t slots,
                                const int64_t *blocks, int64_t block_size, float scale,
                                int threads) {
    return prefill_entry(0, q, cache, cache + kv_heads * slots * dim, out, n, cached, heads,
                         kv_heads, dim, q_tok_stride, q_head_stride, slots * dim, scale, threads,
                         blocks, block_size);
}

/* ---- One row through a pair-interleaved copy of the weight (linear=pairs). With two cores,
 * a read streams from memory at what each core keeps in flight, not at what the memory gives:
 * on the AMX Xeon a plain read of 304 MB ran at ~20 GB/s as one stream per core and ~32 GB/s
 * as four to eight (bench/gemv_micro.c's read_streams). amx_one_row walks a weight 32 rows at
 * a time, each row in 64-byte steps; this kernel reads 8 blocks of 16 rows side by side, each
 * block one contiguous run, so a core keeps 8 streams going. On the AMD EPYC fewer streams
 * read faster: the whole one-call batch-1 decode step ran 1.07x and 1.11x faster with 2 streams
 * a thread than with 8, at par with torch's read of the same bytes (bench/pair_streams_ab.py,
 * 200 rounds, 2 threads; 1 stream was at par with 2). So the count is a parameter, 8
 * (linear=pairs) or 2 (linear=pairs2), and the kernel trial picks it.
 *
 * The copy, [out / 16][in / 2][16][2]: block b, pair k holds w[16 b + j][2 k] and
 * w[16 b + j][2 k + 1] for j = 0..15, so one 64-byte load and one `vdpbf16ps` against x's pair
 * k, broadcast, adds to all 16 outputs of the block (in AVX2: two 32-byte loads and four FMAs,
 * below). Each block sums its pairs in order whichever branch runs it, so the result does not
 * depend on the threads. */

/* dst [out / 16][in / 2][16][2] from w [out, in] (bf16; out a multiple of 16, in of 2). */
void pack_pairs(const bf16 *w, bf16 *dst, int64_t in, int64_t out, int threads) {
    const int64_t pairs = in / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < out / 16; b++)
        for (int64_t k = 0; k < pairs; k++)
            for (int64_t j = 0; j < 16; j++) /* 4 bytes: bf16 tensors need only 2-byte alignment */
                memcpy(dst + ((b * pairs + k) * 16 + j) * 2, w + (b * 16 + j) * in + 2 * k, 4);
}

/* Whether linear_pairs can run here: 1 with AVX-512 BF16, 2 with AVX2 and FMA (one row, and
 * several through linear_pairs_rows, either way), 0 without either. */
int linear_pairs_isa(void) {
#ifdef HAVE_DPBF16
    return 1;
#elif defined(HAVE_AVX2_BF16)
    return 2;
#else
    return 0;
#endif
}

#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_BF16)
#define PAIRS_STREAMS 8

#endif

#ifdef HAVE_DPBF16
typedef bf16 pairs_x; /* x as pairs_streams reads it: bf16 pairs, broadcast to vdpbf16ps */

/* y's block b (16 outputs) from its float32 sums: + bias, rounded to bf16 once, stored, or
 * widened into yf as torch's .float() of the bf16 result would give it. */
static inline void pairs_store(__m512 v, int64_t b, const bf16 *bias, bf16 *y, float *yf) {
    if (bias) v = _mm512_add_ps(v, bf16x16_to_f32(bias + 16 * b));
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
    if (yf)
        _mm512_storeu_si512(yf + 16 * b, _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    else
        _mm256_storeu_si256((__m256i *)(y + 16 * b), rounded);
}

/* The blocks [lo, hi) of y from wp, read as S streams: S runs of the blocks side by side, each
 * run one contiguous stretch of the copy. Inlined with S a constant, so each count compiles to
 * its own unrolled loop. */
static inline __attribute__((always_inline)) void pairs_streams(const bf16 *x, const bf16 *wp,
                                                                const bf16 *bias, bf16 *y,
                                                                float *yf, int64_t in,
                                                                int64_t lo, int64_t hi,
                                                                const int S) {
    const int64_t pairs = in / 2, block_elems = 16 * in;
    /* stream s walks the blocks [start(s), start(s + 1)): S runs of n / S or one more */
    const int64_t count = hi - lo, len = count / S;
#define PAIRS_START(s) (lo + count * (s) / S)
    for (int64_t i = 0; i < len; i++) {
        const bf16 *a[PAIRS_STREAMS];
        __m512 c[PAIRS_STREAMS];
        for (int s = 0; s < S; s++) {
            a[s] = wp + (PAIRS_START(s) + i) * block_elems;
            c[s] = _mm512_setzero_ps();
        }
        for (int64_t k = 0; k < pairs; k++) {
            const __m512bh xv = pair_of(x, k);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++)
                c[s] = _mm512_dpbf16_ps(c[s], (__m512bh)_mm512_loadu_si512(a[s] + 32 * k), xv);
        }
        for (int s = 0; s < S; s++) pairs_store(c[s], PAIRS_START(s) + i, bias, y, yf);
    }
    /* the last block of each run one longer than n / S (at most S - 1): each alone, summed in
     * the same order */
    for (int s = 0; s < S; s++)
        for (int64_t b = PAIRS_START(s) + len; b < PAIRS_START(s + 1); b++) {
            const bf16 *a = wp + b * block_elems;
            __m512 c = _mm512_setzero_ps();
            for (int64_t k = 0; k < pairs; k++)
                c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_loadu_si512(a + 32 * k), pair_of(x, k));
            pairs_store(c, b, bias, y, yf);
        }
#undef PAIRS_START
}

#endif /* HAVE_DPBF16 */

#if defined(HAVE_AVX2_BF16)
/* linear=pairs in AVX2 (an AVX2-only AMD EPYC, where one row read each weight row as one
 * stream at about half the host's read rate): the same copy, the same S streams a thread. A
 * pair k of a block is 64 bytes, two halves of 8 outputs, each output's two weights in 32 bits:
 * a shift left by 16 gives w[.][2k] as float32 and a mask of the high half w[.][2k + 1], so 64
 * bytes take 2 loads and 4 FMAs against x widened once (dot_one_avx2 unpacks 16 weights with
 * zero instead, against x widened in that order). Each output sums its products in one
 * accumulator, pair by pair, the even weight's before the odd's: the same bits whatever the
 * streams, threads or rows around it (batch_linear=pairs' tiles below sum in that order too;
 * another order than dot_one_avx2's, so linear=c and linear=pairs differ in the last bits
 * here). */
typedef float pairs_x; /* x as pairs_streams reads it: widened once a call */

/* y's block b from its two halves' float32 sums: + bias, rounded to bf16 once, stored, or
 * widened into yf. */
static inline void pairs_store(__m256 lo, __m256 hi, int64_t b, const bf16 *bias, bf16 *y,
                               float *yf) {
    float v[16];
    _mm256_storeu_ps(v, lo);
    _mm256_storeu_ps(v + 8, hi);
    for (int j = 0; j < 16; j++) {
        const bf16 r = f32_to_bf16(bias ? v[j] + bf16_to_f32(bias[16 * b + j]) : v[j]);
        if (yf) yf[16 * b + j] = bf16_to_f32(r);
        else y[16 * b + j] = r;
    }
}

/* Pair k's weights of a block (at a) as float32: the even and the odd weight of outputs 0-7
 * (w[0], w[1]) and 8-15 (w[2], w[3]). */
static inline __attribute__((always_inline)) void pairs_widen(const bf16 *a, __m256 w[4]) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(a + 16 * h));
        w[2 * h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        w[2 * h + 1] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
}

/* Pair k's products into a row's two accumulators, outputs 0-7 (c[0]) and 8-15 (c[1]): each
 * the even weight's, then the odd's. */
static inline __attribute__((always_inline)) void pairs_fma(const __m256 w[4], __m256 x0,
                                                            __m256 x1, __m256 c[2]) {
    c[0] = _mm256_fmadd_ps(w[0], x0, c[0]);
    c[1] = _mm256_fmadd_ps(w[2], x0, c[1]);
    c[0] = _mm256_fmadd_ps(w[1], x1, c[0]);
    c[1] = _mm256_fmadd_ps(w[3], x1, c[1]);
}

/* The blocks [lo, hi) of y from wp as S streams, as the AVX-512 form above walks them. */
static inline __attribute__((always_inline)) void pairs_streams(const float *x, const bf16 *wp,
                                                                const bf16 *bias, bf16 *y,
                                                                float *yf, int64_t in,
                                                                int64_t lo, int64_t hi,
                                                                const int S) {
    const int64_t pairs = in / 2, block_elems = 16 * in;
    const int64_t count = hi - lo, len = count / S;
#define PAIRS_START(s) (lo + count * (s) / S)
    for (int64_t i = 0; i < len; i++) {
        const bf16 *a[PAIRS_STREAMS];
        __m256 c[PAIRS_STREAMS][2];
        for (int s = 0; s < S; s++) {
            a[s] = wp + (PAIRS_START(s) + i) * block_elems;
            c[s][0] = c[s][1] = _mm256_setzero_ps();
        }
        for (int64_t k = 0; k < pairs; k++) {
            const __m256 x0 = _mm256_broadcast_ss(x + 2 * k), x1 = _mm256_broadcast_ss(x + 2 * k + 1);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                __m256 w[4];
                pairs_widen(a[s] + 32 * k, w);
                pairs_fma(w, x0, x1, c[s]);
            }
        }
        for (int s = 0; s < S; s++) pairs_store(c[s][0], c[s][1], PAIRS_START(s) + i, bias, y, yf);
    }
    for (int s = 0; s < S; s++)
        for (int64_t b = PAIRS_START(s) + len; b < PAIRS_START(s + 1); b++) {
            const bf16 *a = wp + b * block_elems;
            __m256 c[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t k = 0; k < pairs; k++) {
                __m256 w[4];
                pairs_widen(a + 32 * k, w);
                pairs_fma(w, _mm256_broadcast_ss(x + 2 * k), _mm256_broadcast_ss(x + 2 * k + 1), c);
            }
            pairs_store(c[0], c[1], b, bias, y, yf);
        }
#undef PAIRS_START
}

/* ---- Several rows through the same copies in AVX2 (batch_linear=pairs). A tile of R rows (at
 * most PAIRS_AVX2_TILE_ROWS) against one block keeps 2 R sums in registers: per pair k, the
 * block's 64 bytes widened once (2 loads, 2 shifts, 2 masks) feed 4 R FMAs against 2 R
 * broadcasts of x. Five rows fill AVX2's 16 registers (10 sums, 4 weights, 2 of x): on an AMD
 * EPYC Zen 2, 2 threads, a prototype of the small model's 49 matmuls at 32 rows ran 146
 * GFLOP/s (the cores' float32 FMA rate; a square torch.mm: 149) where linear_rows' dot
 * products, 4 weight rows by 3 of x with every weight unpacked once a pass, ran 110; six rows
 * (12 sums: 18 registers) ran 109. Each output sums its pairs in pairs_fma's order, so a
 * row's result is the bits pairs_one_row gives it alone. Each thread takes a share of the
 * blocks and runs every row tile past a block while it is in L1 or L2. */
#define PAIRS_AVX2_TILE_ROWS 5

static inline __attribute__((always_inline)) void pairs_tile_avx2(const float *x, const bf16 *wp,
                                                                  const bf16 *bias, bf16 *y,
                                                                  float *yf, int64_t in,
                                                                  int64_t out, int64_t b,
                                                                  const int R) {
    const int64_t pairs = in / 2;
    __m256 c[PAIRS_AVX2_TILE_ROWS][2];
    for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    const bf16 *a = wp + b * 16 * in;
    for (int64_t k = 0; k < pairs; k++) {
        __m256 w[4];
        pairs_widen(a + 32 * k, w);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            pairs_fma(w, _mm256_broadcast_ss(x + r * in + 2 * k),
                      _mm256_broadcast_ss(x + r * in + 2 * k + 1), c[r]);
    }
    for (int r = 0; r < R; r++)
        pairs_store(c[r][0], c[r][1], b, bias, yf ? NULL : y + r * out, yf ? yf + r * out : NULL);
}

/* Blocks [lo, hi) of every row: tiles of PAIRS_AVX2_TILE_ROWS rows, then the rest. */
static void pairs_rows_avx2_range(const float *x, const bf16 *wp, const bf16 *bias, bf16 *y,
                                  float *yf, int64_t rows, int64_t in, int64_t out, int64_t lo,
                                  int64_t hi) {
    for (int64_t b = lo; b < hi; b++) {
        int64_t r = 0;
        for (; r + PAIRS_AVX2_TILE_ROWS <= rows; r += PAIRS_AVX2_TILE_ROWS)
            pairs_tile_avx2(x + r * in, wp, bias, y ? y + r * out : NULL, yf ? yf + r * out : NULL,
                            in, out, b, PAIRS_AVX2_TILE_ROWS);
        const float *xr = x + r * in;
        bf16 *yr = y ? y + r * out : NULL; /* one of y and yf is NULL */
        float *yfr = yf ? yf + r * out : NULL;
        switch (rows - r) {
        case 4: pairs_tile_avx2(xr, wp, bias, yr, yfr, in, out, b, 4); break;
        case 3: pairs_tile_avx2(xr, wp, bias, yr, yfr, in, out, b, 3); break;
        case 2: pairs_tile_avx2(xr, wp, bias, yr, yfr, in, out, b, 2); break;
        case 1: pairs_tile_avx2(xr, wp, bias, yr, yfr, in, out, b, 1); break;
        default: break;
        }
    }
}

/* Returns 0, or -1 when there was no memory for x widened (nothing written then). */
static int pairs_rows_avx2(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, float *yf,
                           int64_t rows, int64_t in, int64_t out, int threads) {
    const int parallel = threads > 1 && rows * out * in >= 65536;
    /* x widened once, for every block (in a step's team once per thread that takes a share,
     * as linear_rows does) */
    const int takes_share = parallel || !step_member || step_member->id == 0;
    float *xf = takes_share ? malloc((size_t)(rows * in) * sizeof(float)) : NULL;
    if (takes_share && !xf) {
        if (!step_member) return -1;
        /* the team's other threads go on to this kernel's barrier: meet them there */
        __atomic_store_n(&step_member->state->failed, 1, __ATOMIC_RELAXED);
        FOR_SHARE((int64_t)0, parallel, threads, (void)lo);
        return 0;
    }
    if (xf)
        for (int64_t i = 0; i < rows * in; i++) xf[i] = bf16_to_f32(x[i]);
    FOR_SHARE(out / 16, parallel, threads,
              pairs_rows_avx2_range(xf, wp, bias, y, yf, rows, in, out, lo, hi));
    free(xf);
    return 0;
}
#endif /* HAVE_AVX2_BF16 */

#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_BF16)
/* One row, each thread's share of the blocks read as `streams` runs side by side: 2, or
 * PAIRS_STREAMS for any other value. Each block sums its pairs in order either way: the same
 * bits. */
static void pairs_one_row(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, float *yf,
                          int64_t in, int64_t out, int threads, int streams) {
    const int64_t blocks = out / 16;
    const int parallel = threads > 1 && out * in >= 65536;
#ifdef HAVE_DPBF16
    const pairs_x *xs = x;
#else
    pairs_x xs[in > 0 ? in : 1]; /* widened once, for every thread; in a step's team, on each
                                  * thread that takes a share */
    if (parallel || !step_member || step_member->id == 0)
        for (int64_t i = 0; i < in; i++) xs[i] = bf16_to_f32(x[i]);
#endif
    if (streams == 2)
        FOR_SHARE(blocks, parallel, threads, pairs_streams(xs, wp, bias, y, yf, in, lo, hi, 2));
    else
        FOR_SHARE(blocks, parallel, threads,
                  pairs_streams(xs, wp, bias, y, yf, in, lo, hi, PAIRS_STREAMS));
}
#endif

#ifdef HAVE_DPBF16

/* ---- Several rows through the same copies (batch_linear=pairs). A tile of R rows (at most 8)
 * and B blocks (48 outputs) keeps R x B float32 sums in registers: per pair k, B 64-byte
 * loads of the copy and R broadcasts of x feed R x B `vdpbf16ps`. Each thread takes a share of
 * the blocks and runs every row tile past each group of B blocks while that group is in its
 * L2, so the weights come from memory once per step whatever the rows. Each output sums its
 * pairs in order in one accumulator, as pairs_one_row does: a row's result is the same bits
 * at any batch size, tile or thread count.
 *
 * Only the first row tile reads a group from memory; the rest reread it from L2. Alone, that
 * first tile asks for the group faster than the host streams it (3 blocks of a 1,024-wide
 * weight, 96 KB, in ~3.4 us of dot products at 3.6 GHz: ~28 GB/s a core) and waits, while
 * the later tiles leave the memory idle. So from PAIRS_PREFETCH_ROWS rows on (two full tiles),
 * the tiles after the first prefetch the next group into L2 between them, one line per block
 * per pair k, the group's blocks split over those tiles by their rows. At 24 and 32 rows on an
 * AMD EPYC (Zen 4) the 49 matmuls of the small model took 0.84-0.94 of their time without it;
 * at 12 rows (one full tile and a tail of 4, the whole group prefetched in the short tail) it
 * cost ~5% (bench/pairs_tiles_ab.py --ab-source), so fewer rows prefetch nothing. */
#ifndef PAIRS_TILE_ROWS /* -D for bench A/Bs of the tile's shape */
#define PAIRS_TILE_ROWS 8
#endif
#ifndef PAIRS_TILE_BLOCKS
#define PAIRS_TILE_BLOCKS 3
#endif
#if PAIRS_TILE_ROWS < 1 || PAIRS_TILE_ROWS > 8 /* pairs_group's tails take 1-7 rows */
#error "PAIRS_TILE_ROWS must be 1 to 8"
#endif
#ifndef PAIRS_PREFETCH_ROWS
#define PAIRS_PREFETCH_ROWS (2 * PAIRS_TILE_ROWS)
#endif

static inline __attribute__((always_inline)) void pairs_tile(const bf16 *x, const bf16 *wp,
                                                             const bf16 *bias, bf16 *y,
                                                             float *yf, int64_t in,
                                                             int64_t out, int64_t b0,
                                                             const int R, const int B,
                                                             const int P, const bf16 *pf,
                                                             int64_t pf_blocks) {
    const int64_t pairs = in / 2, block_elems = 16 * in;
    __m512 c[PAIRS_TILE_ROWS][PAIRS_TILE_BLOCKS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < B; j++) c[r][j] = _mm512_setzero_ps();
    const bf16 *a = wp + b0 * block_elems;
    for (int64_t k = 0; k < pairs; k++) {
        __m512bh w[PAIRS_TILE_BLOCKS];
#pragma GCC unroll 8
        for (int j = 0; j < B; j++)
            w[j] = (__m512bh)_mm512_loadu_si512(a + j * block_elems + 32 * k);
        if (P) /* a constant: the tiles that never prefetch compile without the loop */
            for (int64_t j = 0; j < pf_blocks; j++) {
                _mm_prefetch((const char *)(pf + j * block_elems + 32 * k), _MM_HINT_T1);
                KEEP_LOOP();
            }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512bh xv = pair_of(x + r * in, k);
#pragma GCC unroll 8
            for (int j = 0; j < B; j++) c[r][j] = _mm512_dpbf16_ps(c[r][j], w[j], xv);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < B; j++)
            pairs_store(c[r][j], b0 + j, bias, yf ? NULL : y + r * out, yf ? yf + r * out : NULL);
}

/* Rows [0, rows) against blocks [b0, b0 + B): row tiles of 8, then the rest. */
static inline __attribute__((always_inline)) void pairs_group(const bf16 *x, const bf16 *wp,
                                                              const bf16 *bias, bf16 *y,
                                                              float *yf, int64_t rows,
                                                              int64_t in, int64_t out,
                                                              int64_t b0, const int B,
                                                              int64_t next_blocks) {
    const int64_t block_elems = 16 * in, later = rows - PAIRS_TILE_ROWS;
    int64_t r = 0;
    /* The tile of rows [r, r + R) after the first prefetches the next group's blocks
     * [(r - T) n / later, (r + R - T) n / later), T the first tile's rows and `later` the rows
     * after it: each tile a share of the blocks by its rows, so a short tail takes a short
     * share. Set only where next_blocks is (at least two full tiles). */
#define PF_LO (r < PAIRS_TILE_ROWS ? 0 : (r - PAIRS_TILE_ROWS) * next_blocks / later)
#define PF_HI(R) (r < PAIRS_TILE_ROWS ? 0 : (r + (R) - PAIRS_TILE_ROWS) * next_blocks / later)
#define PAIRS_PF(R) wp + (b0 + B + PF_LO) * block_elems, PF_HI(R) - PF_LO
    for (; r + PAIRS_TILE_ROWS <= rows; r += PAIRS_TILE_ROWS)
        if (next_blocks && r >= PAIRS_TILE_ROWS)
            pairs_tile(x + r * in, wp, bias, y ? y + r * out : NULL, yf ? yf + r * out : NULL,
                       in, out, b0, PAIRS_TILE_ROWS, B, 1, PAIRS_PF(PAIRS_TILE_ROWS));
        else
            pairs_tile(x + r * in, wp, bias, y ? y + r * out : NULL, yf ? yf + r * out : NULL,
                       in, out, b0, PAIRS_TILE_ROWS, B, 0, NULL, 0);
    const bf16 *xr = x + r * in;
    bf16 *yr = y ? y + r * out : NULL; /* one of y and yf is NULL */
    float *yfr = yf ? yf + r * out : NULL;
    switch (rows - r) {
#define PAIRS_TAIL(n) \
    case n: \
        if (n < PAIRS_TILE_ROWS && next_blocks) \
            pairs_tile(xr, wp, bias, yr, yfr, in, out, b0, n, B, 1, PAIRS_PF(n)); \
        else if (n < PAIRS_TILE_ROWS) \
            pairs_tile(xr, wp, bias, yr, yfr, in, out, b0, n, B, 0, NULL, 0); \
        break;
        PAIRS_TAIL(1) PAIRS_TAIL(2) PAIRS_TAIL(3) PAIRS_TAIL(4) PAIRS_TAIL(5) PAIRS_TAIL(6)
        PAIRS_TAIL(7)
#undef PAIRS_TAIL
    default: break;
    }
#undef PAIRS_PF
#undef PF_LO
#undef PF_HI
}

/* Blocks [lo, hi) of pairs_rows' output: groups of PAIRS_TILE_BLOCKS, then single blocks. */
static void pairs_rows_range(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y,
                             float *yf, int64_t rows, int64_t in, int64_t out, int64_t lo,
                             int64_t hi) {
    int64_t b = lo;
    for (; b + PAIRS_TILE_BLOCKS <= hi; b += PAIRS_TILE_BLOCKS) {
        int64_t next = hi - b - PAIRS_TILE_BLOCKS;
        next = next < PAIRS_TILE_BLOCKS ? next : PAIRS_TILE_BLOCKS;
        pairs_group(x, wp, bias, y, yf, rows, in, out, b, PAIRS_TILE_BLOCKS,
                    rows >= PAIRS_PREFETCH_ROWS ? next : 0);
    }
    for (; b < hi; b++) pairs_group(x, wp, bias, y, yf, rows, in, out, b, 1, 0);
}

/* A prefill's many rows: each row tile against PAIRS_SPAN_GROUPS groups in turn. Above, every
 * group reads all of x past its blocks, from L3 once x outgrows L2 (2,000 rows of a 3,072-wide
 * x are 12 MB); here a tile's rows come from L3 once for that many groups and from L1/L2 for
 * the rest, while the span's weights (4 x 295 KB at that width) come from L2/L3. On an AMD EPYC
 * (Zen 4), 2,000 rows of the 3B model's gate/up at one thread: 211-214 GFLOP/s through groups
 * alone, 223 through spans of 4, against 219 at 64 rows (231 for a 480-wide output, x and
 * weights in L2) and one core's measured vdpbf16ps rate of 233.5 (bench/dpbf16_peak.c). At 2
 * threads and 2,000 rows the small model's 49 matmuls and one layer of the 3B's took 0.977 and
 * 0.972 of their time (bench/pairs_tiles_ab.py --rows 2000 --ab-source), and a 4-layer cut of
 * the 3B prefilled 2,000 tokens 1.031x and 1.052x as fast (bench/prefill_ab.py --ab-source;
 * 1.001x against the same source). From 256 to 1,000 rows spans read 0.98-1.03x, mixed, hence
 * PAIRS_SPAN_MIN_ROWS. Spans of 2 gained 0-1.6% less than 4, and the next span's weights
 * prefetched as pairs_group does added nothing. Each output still sums its pairs in one order:
 * the same bits as at any other row count. */
#ifndef PAIRS_SPAN_GROUPS
#define PAIRS_SPAN_GROUPS 4
#endif
#ifndef PAIRS_SPAN_MIN_ROWS
#define PAIRS_SPAN_MIN_ROWS 1024
#endif
#if PAIRS_SPAN_GROUPS < 1 /* a span of no blocks would never advance */
#error "PAIRS_SPAN_GROUPS must be at least 1"
#endif

/* Blocks [lo, hi) of pairs_rows' output in spans of PAIRS_SPAN_GROUPS groups, the rest as
 * pairs_rows_range takes them. */
static void pairs_rows_spans(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y,
                             float *yf, int64_t rows, int64_t in, int64_t out, int64_t lo,
                             int64_t hi) {
    const int64_t span = PAIRS_SPAN_GROUPS * PAIRS_TILE_BLOCKS;
    int64_t b = lo;
    for (; b + span <= hi; b += span) {
        int64_t r = 0;
        for (; r + PAIRS_TILE_ROWS <= rows; r += PAIRS_TILE_ROWS)
            for (int g = 0; g < PAIRS_SPAN_GROUPS; g++)
                pairs_tile(x + r * in, wp, bias, y ? y + r * out : NULL,
                           yf ? yf + r * out : NULL, in, out, b + g * PAIRS_TILE_BLOCKS,
                           PAIRS_TILE_ROWS, PAIRS_TILE_BLOCKS, 0, NULL, 0);
        if (r < rows) /* the last rows, fewer than a tile: pairs_group's tails */
            for (int g = 0; g < PAIRS_SPAN_GROUPS; g++)
                pairs_group(x + r * in, wp, bias, y ? y + r * out : NULL,
                            yf ? yf + r * out : NULL, rows - r, in, out,
                            b + g * PAIRS_TILE_BLOCKS, PAIRS_TILE_BLOCKS, 0);
    }
    pairs_rows_range(x, wp, bias, y, yf, rows, in, out, b, hi);
}

static void pairs_rows(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, float *yf,
                       int64_t rows, int64_t in, int64_t out, int threads) {
    const int parallel = threads > 1 && rows * out * in >= 65536;
    if (rows >= PAIRS_SPAN_MIN_ROWS)
        FOR_SHARE(out / 16, parallel, threads,
                  pairs_rows_spans(x, wp, bias, y, yf, rows, in, out, lo, hi));
    else
        FOR_SHARE(out / 16, parallel, threads,
                  pairs_rows_range(x, wp, bias, y, yf, rows, in, out, lo, hi));
}
#endif

/* Whether linear_pairs_rows takes several rows here: as linear_pairs_isa, since each ISA
 * with one row has its tiles. A library built from a source before this function exports
 * linear_pairs_rows without it, and before AVX2 had its tiles answered 0 for several rows
 * there: NativeOps then counts several rows only with AVX-512 BF16. */
int linear_pairs_rows_isa(void) { return linear_pairs_isa(); }

/* y [rows, out] = x [rows, in] @ w^T (+ bias) in bf16 from wp, w's pack_pairs copy; y bf16,
 * or when yf is set, float32 (the bf16 results widened) there instead. One row takes
 * linear_pairs' kernel (`streams` a thread: 2, else 8), several the row tiles above; each
 * row's result is the same bits either way. Returns 1 when it ran, 0 when this build has no
 * kernel (neither AVX-512 BF16 nor AVX2), -1 when AVX2's copy of x found no memory outside a
 * step's team (inside one the team's failed flag is set and 1 returned, as linear_many_rows
 * does). */
int linear_pairs_rows(const void *x, const void *wp, const void *bias, void *y, float *yf,
                      int64_t rows, int64_t in, int64_t out, int threads, int streams) {
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_BF16)
    if (rows == 1) {
        pairs_one_row((const bf16 *)x, (const bf16 *)wp, (const bf16 *)bias, (bf16 *)y, yf, in,
                      out, threads, streams);
        return 1;
    }
#endif
#ifdef HAVE_DPBF16
    pairs_rows((const bf16 *)x, (const bf16 *)wp, (const bf16 *)bias, (bf16 *)y, yf, rows, in,
               out, threads);
    return 1;
#elif defined(HAVE_AVX2_BF16)
    (void)streams;
    return pairs_rows_avx2((const bf16 *)x, (const bf16 *)wp, (const bf16 *)bias, (bf16 *)y, yf,
                           rows, in, out, threads) < 0
               ? -1
               : 1;
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)yf, (void)rows, (void)in, (void)out,
        (void)threads, (void)streams;
    return 0;
#endif
}

/* y [out] = x [in] @ w [out, in]^T (+ bias [out]) for one row of bf16, from wp, w's
 * pack_pairs copy; y bf16, or when yf is set, float32 (the bf16 result widened) there instead.
 * Each thread reads its share as `streams` runs side by side (2, else 8). Returns 1 when it
 * ran, 0 when this build has neither AVX-512 BF16 nor AVX2. */
int linear_pairs(const void *x, const void *wp, const void *bias, void *y, float *yf, int64_t in,
                 int64_t out, int threads, int streams) {
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_BF16)
    pairs_one_row((const bf16 *)x, (const bf16 *)wp, (const bf16 *)bias, (bf16 *)y, yf, in, out,
                  threads, streams);
    return 1;
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)yf, (void)in, (void)out, (void)threads,
        (void)streams;
    return 0;
#endif
}

/* ---- A decodes-only step's decoder layers in one call. Through the per-kernel wrappers a
 * batch-1 step of the small model (12 layers) is ~110 calls from Python, each paying the
 * interpreter, ctypes' argument conversion, tensor checks and an allocation (one call here:
 * batch-1 decode 1.24x faster, AMX Xeon, 2 threads, bench/decode_ops_ab.py --one-call). Here the same kernels run in the same order on the same
 * buffers, so the result is bit for bit the per-kernel path's; Python makes one call.
 * Per layer: h = norm(residual) (fused with the residual add of the layer before), qkv, the
 * q/k norms + rope + K/V write, paged attention, o, residual += o and norm, gate_up, silu * up,
 * down; the last layer's residual add is fused into the final norm, written to `out`. */

/* One decoder layer: its weights (model dtype; biases and q/k norms NULL when absent), its
 * KV cache [2, kv_heads, slots, dim], and its matmul weights' pack_pairs copies (NULL when
 * linear=pairs is not chosen). Mirrored by engine/native.py's DecodeLayer. */
typedef struct {
    const void *input_norm, *qkv_w, *qkv_b, *q_norm, *k_norm, *o_w, *post_norm, *gate_up_w,
        *down_w;
    void *kv;
    const void *qkv_p, *o_p, *gate_up_p, *down_p;
} decode_layer;

/* The step's shapes, its batch (as paged_decode_attention and qkv_rope_store take it) and how
 * to run each kernel. Mirrored by engine/native.py's DecodeStep. */
typedef struct {
    int64_t layers, rows, hidden, heads, kv_heads, dim, inter, slots, block_size, table_width;
    const int64_t *positions, *slot_mapping, *tables, *bounds;
    const float *cos_table, *sin_table;
    const void *final_norm;
    double eps, qk_eps, scale;
    int64_t bf, threads, many_rows, wide_glue;
    /* decode_logits only: the LM head [vocab, hidden], no bias; when `embed` is set, the step's
     * token ids [rows] and the embedding [vocab, hidden] the residual is first copied from;
     * when `argmax` is set, each row's greedy token [rows] (argmax_rows) is written there. */
    const void *lm_head;
    int64_t vocab;
    const int64_t *ids;
    const void *embed;
    int64_t *argmax;
    /* pairs: the matmuls read the layers' pack_pairs copies (linear_pairs_rows: linear=pairs
     * at one row, batch_linear=pairs at several), and the LM head its copy lm_head_p, where
     * set */
    const void *lm_head_p;
    int64_t pairs;
    int64_t pair_streams; /* one-row matmuls over the copies: streams a thread (linear_pairs) */
} decode_step;

static void step_norm(const decode_step *s, const void *x, void *residual, const void *w,
                      void *out) {
    if (s->wide_glue && s->bf)
        rms_norm_bf16(x, residual, w, out, s->rows, s->hidden, (float)s->eps, (int)s->threads);
    else
        rms_norm(x, residual, w, out, s->rows, s->hidden, (float)s->eps, (int)s->bf,
                 (int)s->threads);
}

static int step_linear(const decode_step *s, const void *x, const void *w, const void *wp,
                       const void *bias, void *y, int64_t in, int64_t out) {
    if (s->pairs && wp) {
        const int ran = linear_pairs_rows(x, wp, bias, y, NULL, s->rows, in, out,
                                          (int)s->threads, (int)s->pair_streams);
        if (ran) return ran < 0 ? -1 : 0;
    }
    if (!w) return -1; /* a weight held once (model.py's Linear.hold_once): its copy only */
    if (s->many_rows)
        return linear_many_rows(x, w, bias, y, s->rows, in, out, (int)s->bf, (int)s->threads) < 0
                   ? -1
                   : 0;
    linear_rows(x, w, bias, y, s->rows, in, out, (int)s->bf, (int)s->threads);
    return 0;
}

/* A layer's fused q/k/v projection width, and q's (elements a row). */
static int64_t qkv_width(const decode_step *s) { return (s->heads + 2 * s->kv_heads) * s->dim; }
static int64_t q_width(const decode_step *s) { return s->heads * s->dim; }

static int64_t layer_buffers_bytes(const decode_step *s) {
    const int64_t qkv = qkv_width(s), q = q_width(s);
    const int64_t bytes = s->rows * (qkv + 2 * q + 2 * s->hidden + 3 * s->inter) * (s->bf ? 2 : 4);
    return (bytes + 63) / 64 * 64;
}

/* The layer buffers, then paged_decode_attention's parts for a step's team (attention_parts:
 * fewer than 4 * threads items' worth). */
int64_t decode_layers_scratch(const decode_step *s) {
    const int64_t group = s->heads / s->kv_heads;
    return layer_buffers_bytes(s) +
           4 * (s->threads > 1 ? s->threads : 1) * group * (s->dim + 2) * (int64_t)sizeof(float);
}

#ifdef _OPENMP
/* Pauses a step's barrier spins before it sleeps: as many as libgomp's workers spin at its
 * barriers (GOMP_SPINCOUNT, else OMP_WAIT_POLICY=ACTIVE: without end, else its ~300,000),
 * and never under 1,000 (~20 us on an AMD EPYC; libgomp's own count where its threads
 * outnumber the CPUs), so that GOMP_SPINCOUNT=0 or OMP_WAIT_POLICY=PASSIVE leaves the workers
 * asleep between steps but not between a step's kernels. Not more than a server's short count
 * (GOMP_SPINCOUNT: `pdscope serve` sets 10,000, 1,000 below TEAM_MIN_LAYER_WEIGHTS a layer):
 * a floor of 4,096 (~90 us) under the 1,000 it set before spun longer than the server asked
 * of libgomp, on CPUs its HTTP loop and colocated clients need (a clean-clone CI run with it
 * read a tiny model's 8 streams at 0.83x the output rate of 1, where the test wants 1.5x).
 * Read once: libgomp reads them once too. */
static int barrier_spins(void) {
    static int spins = -1;
    int cached = __atomic_load_n(&spins, __ATOMIC_RELAXED);
    if (cached >= 0) return cached;
    long long told = 300000;
    const char *count = getenv("GOMP_SPINCOUNT"), *policy = getenv("OMP_WAIT_POLICY");
    if (count && *count) {
        char *end;
        told = strtoll(count, &end, 10);
        static const char units[] = "kMGT"; /* libgomp's suffixes: powers of 1,000 */
        const char *unit = *end ? strchr(units, *end) : NULL;
        for (long i = 0; unit && i <= unit - units && told < INT_MAX; i++) told *= 1000;
        if (strncasecmp(count, "infinite", 8) == 0 || strncasecmp(count, "infinity", 8) == 0)
            told = INT_MAX;
    } else if (policy && strncasecmp(policy, "active", 6) == 0) {
        told = INT_MAX;
    } else if (policy && strncasecmp(policy, "passive", 7) == 0) {
        told = 0;
    }
    cached = told < 1000 ? 1000 : told > INT_MAX ? INT_MAX : (int)told;
    __atomic_store_n(&spins, cached, __ATOMIC_RELAXED);
    return cached;
}
#endif

/* Steps run on a team of two threads or more, since the library loaded (for tests). */
static int64_t team_steps;
int64_t decode_team_steps(void) { return __atomic_load_n(&team_steps, __ATOMIC_RELAXED); }

typedef int (*step_body)(const decode_layer *layers, const decode_step *s, void *residual,
                         void *out, void *scratch);

/* A layer's matmul weights (elements) below which a step runs its kernels each in its own
 * region, as outside a team: ~2 MB of bf16 weights a layer and less (the test models, the
 * smallest checkpoints) make kernels of a few microseconds, and a step then waits at its
 * barriers more than it works. The tiny test model (0.74 M a layer) in a team read 8 streams
 * at 1.0-1.14x the output rate of 1 in three clean-clone CI runs, where the server that ran
 * its kernels each in a region read 1.5x and more (2.1-9.5x run alone, either way). */
#define TEAM_MIN_LAYER_WEIGHTS (2 << 20)

static int64_t layer_weights(const decode_step *s) {
    return s->hidden * (qkv_width(s) + q_width(s) + 3 * s->inter);
}

/* body(...) on a team of s->threads (see team_state), every thread running the whole step
 * and its share of each kernel; the result is thread 0's, or -1 where a thread failed. */
static int run_step(step_body body, const decode_layer *layers, const decode_step *s,
                    void *residual, void *out, void *scratch) {
#ifdef _OPENMP
    if (s->threads > 1 && !omp_in_parallel() && layer_weights(s) >= TEAM_MIN_LAYER_WEIGHTS) {
        team_state state;
        memset(&state, 0, sizeof state);
        state.att_parts = (float *)((char *)scratch + layer_buffers_bytes(s));
        /* libgomp's own count where the team outnumbers the process's CPUs (omp_get_num_procs:
         * the calling thread alone may be pinned to one), the step's otherwise */
        state.spins = s->threads > omp_get_num_procs() ? 1000 : barrier_spins();
#ifdef HAVE_AMX
        (void)amx_usable(); /* asked once, here: every thread then sees the same answer */
#endif
        int result = 0;
#pragma omp parallel num_threads((int)s->threads)
        {
            team_member me = {omp_get_thread_num(), omp_get_num_threads(), &state, 0};
            step_member = &me;
            const int r = body(layers, s, residual, out, scratch);
            step_member = NULL;
            if (me.id == 0) result = r;
            if (me.id == 0 && me.n > 1) __atomic_add_fetch(&team_steps, 1, __ATOMIC_RELAXED);
        }
        return __atomic_load_n(&state.failed, __ATOMIC_RELAXED) ? -1 : result;
    }
#endif
    return body(layers, s, residual, out, scratch);
}

/* Every branch below returns the same on every thread of a step's team: a thread that
 * returned early would leave the others waiting at the next kernel's barrier. */
static int layers_body(const decode_layer *layers, const decode_step *s, void *residual,
                       void *out, void *scratch) {
    const int64_t elem = s->bf ? 2 : 4, rows = s->rows;
    const int64_t qkv_n = qkv_width(s), q_n = q_width(s);
    char *qkv = scratch, *q = qkv + rows * qkv_n * elem, *att = q + rows * q_n * elem,
         *h = att + rows * q_n * elem, *o = h + rows * s->hidden * elem,
         *gate_up = o + rows * s->hidden * elem, *act = gate_up + rows * 2 * s->inter * elem;
    const int bf = (int)s->bf, threads = (int)s->threads;
    step_norm(s, residual, NULL, layers[0].input_norm, h);
    for (int64_t i = 0; i < s->layers; i++) {
        const decode_layer *l = layers + i;
        if (step_linear(s, h, l->qkv_w, l->qkv_p, l->qkv_b, qkv, s->hidden, qkv_n)) return -1;
        qkv_rope_store(qkv, q, l->kv, s->positions, s->slot_mapping, s->cos_table, s->sin_table,
                       l->q_norm, l->k_norm, (float)s->qk_eps, rows, s->heads, s->kv_heads,
                       s->dim, s->slots, bf, threads);
        if (paged_decode_attention(q, l->kv, att, s->tables, s->bounds, rows, s->heads,
                                   s->kv_heads, s->dim, s->slots, s->block_size, s->table_width,
                                   (float)s->scale, bf, threads))
            return -1;
        if (step_linear(s, att, l->o_w, l->o_p, NULL, o, q_n, s->hidden)) return -1;
        step_norm(s, o, residual, l->post_norm, h);
        if (step_linear(s, h, l->gate_up_w, l->gate_up_p, NULL, gate_up, s->hidden, 2 * s->inter)) return -1;
        if (s->wide_glue && bf)
            silu_mul_bf16((const bf16 *)gate_up, (bf16 *)act, rows, s->inter, threads);
        else
            silu_mul(gate_up, act, rows, s->inter, bf, threads);
        if (step_linear(s, act, l->down_w, l->down_p, NULL, o, s->inter, s->hidden)) return -1;
        const int last = i + 1 == s->layers;
        step_norm(s, o, residual, last ? s->final_norm : layers[i + 1].input_norm, last ? out : h);
    }
    return 0;
}

/* residual [rows, hidden]: the embedded tokens, updated in place; out [rows, hidden]: the
 * final norm's output; scratch: decode_layers_scratch(s) bytes. Returns 0, or -1 when a
 * kernel could not allocate its scratch memory. */
int decode_layers(const decode_layer *layers, const decode_step *s, void *residual, void *out,
                  void *scratch) {
    return run_step(layers_body, layers, s, residual, out, scratch);
}

/* out[r] = the index of row r's largest value in x [rows, n] as torch.argmax gives it: the
 * first of equal maxima, and the first NaN where a row has one. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        int64_t i = 0, best_i = 0;
        float best = row[0];
#ifdef HAVE_DPBF16
        /* the row's maximum and whether it holds a NaN, 16 lanes at a time; then the first
         * index of that maximum (or of the first NaN) */
        __m512 m = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (; i < n; i += 16) {
            const __mmask16 live = tail16(n - i);
            const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, v);
        }
        best = _mm512_reduce_max_ps(m);
        for (i = 0; i < n; i += 16) {
            const __mmask16 live = tail16(n - i);
            const __m512 v = _mm512_maskz_loadu_ps(live, row + i);
            const __mmask16 hit = (nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                       : _mm512_cmp_ps_mask(v, _mm512_set1_ps(best), _CMP_EQ_OQ)) &
                                  live;
            if (hit) {
                best_i = i + __builtin_ctz(hit);
                break;
            }
        }
#else
        for (i = 1; i < n; i++) {
            const float v = row[i];
            if (v > best || (v != v && best == best)) {
                best = v;
                best_i = i;
            }
        }
#endif
        out[r] = best_i;
    }
}

int64_t decode_logits_scratch(const decode_step *s) {
    const int64_t elem = s->bf ? 2 : 4;
    return decode_layers_scratch(s) + 2 * s->rows * s->hidden * elem +
           (s->bf ? s->rows * s->vocab * 2 : 0);
}

/* The rows' logits, float32 [rows, vocab], after decode_layers in the same call: the final
 * norm's output through the LM head on the step's matmul kernel, each value rounded to the
 * model dtype and then widened, the bits the per-kernel path's lm_head(hidden).float() gives.
 * A one-row AMX step writes them widened straight from the tiles; other bf16 steps go through
 * a bf16 copy in scratch (decode_logits_scratch(s) bytes). The one-row branch below repeats
 * linear_many_rows' own test for its one-row AMX kernel: the two must change together, or the
 * logits leave the per-kernel path's bits (the bit-for-bit test in test_engine.py says so).
 * residual: as decode_layers', or NULL when `s->embed` is set (then it lives in scratch).
 * Returns 0, -1 as decode_layers, -2 when a token id lies outside the embedding, or -3 when
 * s->pairs is set in a build with no linear_pairs_rows kernel for s->rows. */
static void embed_rows(const decode_step *s, void *residual, int64_t row_bytes, int64_t lo,
                       int64_t hi) {
    for (int64_t r = lo; r < hi; r++)
        memcpy((char *)residual + r * row_bytes, (const char *)s->embed + s->ids[r] * row_bytes,
               (size_t)row_bytes);
}

static void widen_bf16(const bf16 *src, float *dst, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; i++) dst[i] = bf16_to_f32(src[i]);
}

static int logits_body(const decode_layer *layers, const decode_step *s, void *residual,
                       void *out, void *scratch) {
    float *logits = out;
    const int64_t elem = s->bf ? 2 : 4, row_bytes = s->hidden * elem;
    const int threads = (int)s->threads;
    char *normed = (char *)scratch + decode_layers_scratch(s);
    char *embedded = normed + s->rows * row_bytes;
    bf16 *rounded = (bf16 *)(embedded + s->rows * row_bytes);
    if (s->embed) {
        if (!residual) residual = embedded;
        for (int64_t r = 0; r < s->rows; r++)
            if (s->ids[r] < 0 || s->ids[r] >= s->vocab) return -2;
        FOR_SHARE(s->rows, 0, threads, embed_rows(s, residual, row_bytes, lo, hi));
    }
    if (layers_body(layers, s, residual, normed, scratch)) return -1;
    if (!s->bf) {
        if (step_linear(s, normed, s->lm_head, NULL, NULL, logits, s->hidden, s->vocab)) return -1;
    }
    /* step_linear's pairs branch, its output widened in place of stored (the caller sets
     * pairs only where linear_pairs_rows has a kernel for these rows, so a 0 from it is an
     * error here) */
    else if (s->pairs && s->lm_head_p) {
        const int ran = linear_pairs_rows(normed, s->lm_head_p, NULL, NULL, logits, s->rows,
                                          s->hidden, s->vocab, threads, (int)s->pair_streams);
        if (ran < 0) return -1;
        if (!ran) return -3;
    }
#ifdef HAVE_AMX
    /* linear_many_rows' one-row branch, its output widened in place of stored */
    else if (s->many_rows && s->rows == 1 && s->hidden % 32 == 0 && s->vocab % 16 == 0 &&
             s->lm_head && amx_usable())
        amx_one_row((const bf16 *)normed, s->lm_head, NULL, NULL, logits, s->hidden, s->vocab,
                    threads);
#endif
    else {
        if (step_linear(s, normed, s->lm_head, NULL, NULL, rounded, s->hidden, s->vocab)) return -1;
        const int64_t n = s->rows * s->vocab;
        FOR_SHARE(n, threads > 1 && n >= 262144, threads, widen_bf16(rounded, logits, lo, hi));
    }
    if (s->argmax)
        FOR_SHARE(s->rows, threads > 1 && s->rows > 1, threads,
                  argmax_rows(logits + lo * s->vocab, hi - lo, s->vocab, s->argmax + lo));
    return 0;
}

int decode_logits(const decode_layer *layers, const decode_step *s, void *residual,
                  float *logits, void *scratch) {
    return run_step(logits_body, layers, s, residual, logits, scratch);
}
