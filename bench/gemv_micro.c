/* One-row bf16 matmul passes over the small model's 49 weights (304 MB), against a plain read
 * of the same bytes, interleaved in one process: where does the one-row AMX pass lose to the
 * read rate? Standalone C, so Python's per-call costs are out of the picture. Build and run
 * (threads from OMP_NUM_THREADS; rounds as the argument):
 *   gcc -O3 -march=native -fopenmp bench/gemv_micro.c -o /tmp/gemv_micro
 *   OMP_NUM_THREADS=1 /tmp/gemv_micro 25
 * Prints, per variant, the median over rounds of amx_rows' time over its own (>1: faster than
 * amx_rows), then its median time. Variants: read (an AVX-512 sum of the weight bytes),
 * amx_rows (the engine's kernel before issue 12m: A tiles loaded at the weight's row stride,
 * one L2 software prefetch per 64 bytes of the next 32-row block), amx_rows_nopf (the same
 * without the prefetch: the engine's kernel since), amx_tiled / amx_tiled_pf (weights re-laid
 * so each 16x32 A tile is 1 KB contiguous: one sequential stream), avx_tiled (that layout
 * through vdpbf16ps, 16 accumulators a block), avx_rows / avx_rows8 / avx_rows16
 * (linear_rows' form, four weight rows at a time; eight; sixteen), read_streams4 /
 * read_streams8 (the read, each thread's share split in 4 or 8 parts summed side by side:
 * what a core reads when it keeps several streams going) and pairs8 (linear=pairs: the
 * weights re-laid [out/16][in/2][16][2] on huge pages, eight 16-row blocks side by side per
 * thread, one vdpbf16ps per 64-byte load against x's pair broadcast). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef uint16_t bf16;
enum { NW = 49 };
static int64_t OUT[NW], IN[NW];
static bf16 *W[NW], *T[NW], *H[NW], *P[NW], *X[NW], *Y[NW];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

static void amx_conf(void) {
    struct cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

static volatile float sink;

static void run_read(int i) {
    const int64_t n = OUT[i] * IN[i] / 32; /* zmm of bf16 */
    float total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
    for (int64_t c = 0; c < n / 64; c++) {
        __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
        const __m512 *p = (const __m512 *)(W[i]) + c * 64;
        for (int j = 0; j < 64; j += 2) a = _mm512_add_ps(a, p[j]), b = _mm512_add_ps(b, p[j + 1]);
        total += _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
    sink = total;
}

/* The read with each thread's share as S streams side by side. */
static void run_read_streams(int i, const int S) {
    const int64_t n = OUT[i] * IN[i] / 32; /* zmm of bf16 */
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = n * id / nt, len = (n * (id + 1) / nt - lo) / S;
        const __m512 *p = (const __m512 *)(W[i]) + lo;
        __m512 a[8];
        for (int s = 0; s < S; s++) a[s] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j++)
            for (int s = 0; s < S; s++) a[s] = _mm512_add_ps(a[s], p[s * len + j]);
        for (int s = 0; s < S; s++) total += _mm512_reduce_add_ps(a[s]);
    }
    sink = total;
}

/* linear=pairs' kernel: 8 blocks of 16 rows side by side per thread over P's layout. */
static void run_pairs(int i) {
    const int64_t blocks = OUT[i] / 16, pairs = IN[i] / 2;
#pragma omp parallel
    {
        const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
        /* run s: blocks [start(s), start(s + 1)), n / 8 of them side by side, then the rest */
        const int64_t lo = blocks * id / nt, n = blocks * (id + 1) / nt - lo, per = n / 8;
#define START(s) (lo + n * (s) / 8)
        for (int64_t j = 0; j < per; j++) {
            __m512 c[8];
            for (int s = 0; s < 8; s++) c[s] = _mm512_setzero_ps();
            for (int64_t k = 0; k < pairs; k++) {
                uint32_t xv;
                memcpy(&xv, X[i] + 2 * k, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xv);
                for (int s = 0; s < 8; s++)
                    c[s] = _mm512_dpbf16_ps(
                        c[s], (__m512bh)_mm512_loadu_si512(P[i] + ((START(s) + j) * pairs + k) * 32),
                        xb);
            }
            for (int s = 0; s < 8; s++)
                _mm256_storeu_si256((__m256i *)(Y[i] + (START(s) + j) * 16),
                                    (__m256i)_mm512_cvtneps_pbh(c[s]));
        }
        for (int s = 0; s < 8; s++)
            for (int64_t b = START(s) + per; b < START(s + 1); b++) {
                __m512 c = _mm512_setzero_ps();
                for (int64_t k = 0; k < pairs; k++) {
                    uint32_t xv;
                    memcpy(&xv, X[i] + 2 * k, 4);
                    c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_loadu_si512(P[i] + (b * pairs + k) * 32),
                                         (__m512bh)_mm512_set1_epi32((int)xv));
                }
                _mm256_storeu_si256((__m256i *)(Y[i] + b * 16), (__m256i)_mm512_cvtneps_pbh(c));
            }
#undef START
    }
}

/* x packed as the B tile for one row: pairs k/2 at column 0, rest zero. */
static uint32_t *XP[NW];

static void store_col0(int i, int64_t r0, float *c) {
    for (int r = 0; r < 16; r++) {
        float f = c[r * 16];
        uint32_t u;
        memcpy(&u, &f, 4);
        Y[i][r0 + r] = (bf16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

static void run_amx(int i, int tiled, int pf) {
    const int64_t in = IN[i], out = OUT[i], blocks = out / 32;
#pragma omp parallel
    {
        amx_conf();
        float c[256];
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t r0 = blk * 32;
            _tile_zero(0);
            _tile_zero(2);
            const bf16 *a0, *a1;
            int64_t stride, step;
            if (tiled == 2) {
                a0 = H[i] + r0 * in, a1 = a0 + 16 * in, stride = in * 2, step = 32;
            } else if (tiled) {
                a0 = T[i] + r0 * in, a1 = a0 + 16 * in, stride = 64, step = 512;
            } else {
                a0 = W[i] + r0 * in, a1 = a0 + 16 * in, stride = in * 2, step = 32;
            }
            const char *next = (const char *)(tiled ? T[i] : W[i]) + (r0 + 32) * in * 2;
            const int64_t next_bytes = blk + 1 < blocks ? 32 * in * 2 : 0;
            const int64_t per = ((next_bytes / (in / 32) + 63) / 64) * 64;
            for (int64_t k = 0; k < in / 32; k++) {
                if (pf)
                    for (int64_t off = k * per; off < (k + 1) * per && off < next_bytes; off += 64)
                        _mm_prefetch(next + off, _MM_HINT_T1);
                _tile_loadd(4, a0 + k * step, stride);
                _tile_loadd(6, XP[i] + k * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(5, a1 + k * step, stride);
                _tile_dpbf16ps(2, 5, 6);
            }
            _tile_stored(0, c, 64);
            store_col0(i, r0, c);
            _tile_stored(2, c, 64);
            store_col0(i, r0 + 16, c);
        }
        _tile_release();
    }
}

static inline __m512 sum16(const __m512 v[16]) {
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
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

static void run_avx_tiled(int i) {
    const int64_t in = IN[i], out = OUT[i], blocks = out / 16;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        const bf16 *a = T[i] + blk * 16 * in;
        for (int64_t k = 0; k < in / 32; k++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(X[i] + k * 32);
            for (int r = 0; r < 16; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_load_si512(a + k * 512 + r * 32), xv);
        }
        __m256bh y = _mm512_cvtneps_pbh(sum16(acc));
        _mm256_storeu_si256((__m256i *)(Y[i] + blk * 16), (__m256i)y);
    }
}

static void run_avx_rows(int i) {
    const int64_t in = IN[i], out = OUT[i], blocks = out / 4;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        const bf16 *w = W[i] + blk * 4 * in;
        for (int64_t k = 0; k < in; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(X[i] + k);
            for (int r = 0; r < 4; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * in + k), xv);
        }
        for (int r = 0; r < 4; r++) sink = _mm512_reduce_add_ps(acc[r]);
    }
}

/* linear_rows' form with `R` weight rows a block: more streams in flight per thread. */
static inline __attribute__((always_inline)) void avx_rows_n(int i, const int R) {
    const int64_t in = IN[i], out = OUT[i], blocks = out / R;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m512 acc[16];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        const bf16 *w = W[i] + blk * R * in;
        for (int64_t k = 0; k < in; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(X[i] + k);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * in + k), xv);
        }
        if (R == 16) {
            __m256bh y = _mm512_cvtneps_pbh(sum16(acc));
            _mm256_storeu_si256((__m256i *)(Y[i] + blk * 16), (__m256i)y);
        } else {
            for (int r = 0; r < R; r++) sink = _mm512_reduce_add_ps(acc[r]);
        }
    }
}

static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 9;
    syscall(SYS_arch_prctl, 0x1023, 18);
    const int64_t shapes[4][2] = {{1536, 1024}, {1024, 1024}, {5632, 1024}, {1024, 2816}};
    double bytes = 0;
    for (int i = 0; i < NW; i++) {
        OUT[i] = i < 48 ? shapes[i % 4][0] : 16384;
        IN[i] = i < 48 ? shapes[i % 4][1] : 1024;
        const size_t n = OUT[i] * IN[i];
        bytes += n * 2.0;
        W[i] = aligned_alloc(64, n * 2);
        T[i] = aligned_alloc(64, n * 2);
        /* H: W's bytes on transparent huge pages (asked for before the first touch) */
        H[i] = aligned_alloc(1 << 21, (n * 2 + (1 << 21) - 1) & ~(size_t)((1 << 21) - 1));
        madvise(H[i], (n * 2 + (1 << 21) - 1) & ~(size_t)((1 << 21) - 1), MADV_HUGEPAGE);
        X[i] = aligned_alloc(64, IN[i] * 2);
        Y[i] = aligned_alloc(64, OUT[i] * 2);
        XP[i] = aligned_alloc(64, IN[i] / 2 * 16 * 4);
        for (size_t j = 0; j < n; j++) W[i][j] = 0x3f80 + (j * 7 % 13);
        memcpy(H[i], W[i], n * 2);
        P[i] = aligned_alloc(1 << 21, (n * 2 + (1 << 21) - 1) & ~(size_t)((1 << 21) - 1));
        madvise(P[i], (n * 2 + (1 << 21) - 1) & ~(size_t)((1 << 21) - 1), MADV_HUGEPAGE);
        for (int64_t r = 0; r < OUT[i]; r++) /* [out/16][in/2][16][2] */
            for (int64_t k = 0; k < IN[i]; k++)
                P[i][((r / 16) * (IN[i] / 2) + k / 2) * 32 + (r % 16) * 2 + k % 2] =
                    W[i][r * IN[i] + k];
        for (int64_t j = 0; j < IN[i]; j++) X[i][j] = 0x3f00 + (j % 5);
        memset(XP[i], 0, IN[i] / 2 * 16 * 4);
        for (int64_t k = 0; k < IN[i] / 2; k++) memcpy(XP[i] + k * 16, X[i] + 2 * k, 4);
        /* tiled: block of 16 rows, then 32-column tiles, each 16 rows x 64 bytes */
        for (int64_t r = 0; r < OUT[i]; r++)
            for (int64_t k = 0; k < IN[i]; k++)
                T[i][(r / 16) * 16 * IN[i] + (k / 32) * 512 + (r % 16) * 32 + k % 32] =
                    W[i][r * IN[i] + k];
    }
    const char *names[] = {"read", "amx_rows", "amx_rows_nopf", "amx_tiled", "amx_tiled_pf",
                           "avx_tiled", "avx_rows", "avx_rows8", "avx_rows16", "amx_rows_huge",
                           "read_streams4", "read_streams8", "pairs8"};
    enum { NV = 13 };
    double *t[NV];
    for (int v = 0; v < NV; v++) t[v] = calloc(rounds, sizeof(double));
    for (int r = -1; r < rounds; r++)
        for (int v = 0; v < NV; v++) {
            const double t0 = now();
            for (int i = 0; i < NW; i++) {
                switch (v) {
                case 0: run_read(i); break;
                case 1: run_amx(i, 0, 1); break;
                case 2: run_amx(i, 0, 0); break;
                case 3: run_amx(i, 1, 0); break;
                case 4: run_amx(i, 1, 1); break;
                case 5: run_avx_tiled(i); break;
                case 6: run_avx_rows(i); break;
                case 7: avx_rows_n(i, 8); break;
                case 8: avx_rows_n(i, 16); break;
                case 9: run_amx(i, 2, 0); break;
                case 10: run_read_streams(i, 4); break;
                case 11: run_read_streams(i, 8); break;
                case 12: run_pairs(i); break;
                }
            }
            if (r >= 0) t[v][r] = now() - t0;
        }
    printf("threads %d, %.0f MB, median of %d rounds:\n", omp_get_max_threads(), bytes / 1e6, rounds);
    double *ratio = calloc(rounds, sizeof(double));
    for (int v = 0; v < NV; v++) { /* median of per-round ratios to amx_rows, then times */
        for (int r = 0; r < rounds; r++) ratio[r] = t[1][r] / t[v][r];
        qsort(ratio, rounds, sizeof(double), cmpd);
        printf("  %-14s speed over amx_rows %5.2f (%4.2f-%4.2f)", names[v], ratio[rounds / 2],
               ratio[0], ratio[rounds - 1]);
        qsort(t[v], rounds, sizeof(double), cmpd);
        const double m = t[v][rounds / 2];
        printf("  %6.2f ms  %5.1f GB/s\n", m * 1e3, bytes / m / 1e9);
    }
    return 0;
}
