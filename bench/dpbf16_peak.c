/* The cores' own bf16 dot-product rate, measured: how many GFLOP/s `vdpbf16ps` gives when
 * nothing but registers feed it. A batch-32 decode step is compute-bound on the pairs copies,
 * so this rate bounds how fast the step can be, and with it batch 32 over batch 1 (issue 12):
 * the step's FLOPs (2 x parameters x rows) over this rate is its floor. Standalone C, so
 * neither Python nor memory stands between the instruction and the clock. Build and run
 * (threads from OMP_NUM_THREADS; rounds as the argument):
 *   gcc -O3 -march=native -fopenmp bench/dpbf16_peak.c -o /tmp/dpbf16_peak
 *   OMP_NUM_THREADS=2 /tmp/dpbf16_peak 9
 * Prints the median and best GFLOP/s over rounds of each form: 512-bit and 256-bit
 * `vdpbf16ps` (64 and 32 FLOPs an instruction: 16 or 8 lanes, two products and two adds each),
 * and 512-bit float32 FMA (32 FLOPs) for comparison. Each round runs every form on every thread
 * at once (~0.3 s for the 512-bit forms here), 24 independent accumulators a thread so that
 * latency never binds; the median is the middle round's (the upper one of an even count). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 24
#define ITERS 40000000L

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One form: CHAINS accumulators of type ACC, each stepped ITERS times by STEP(acc, a, b) with
 * operands of type OPND from A0 and B0 (hidden from the compiler every iteration). It returns
 * the sum of every accumulator's first lane (the accumulators summed, then their lanes stored)
 * so that the compiler keeps every instruction. */
#define PEAK_FORM(NAME, ACC, OPND, SET1, A0, B0, STEP, ADD, STORE, LANES)   \
    static float NAME(float seed) {                                           \
        ACC acc[CHAINS];                                                      \
        for (int c = 0; c < CHAINS; c++) acc[c] = SET1(seed + c);             \
        OPND a = A0, b = B0;                                                  \
        for (long i = 0; i < ITERS; i++) {                                    \
            _Pragma("GCC unroll 24") for (int c = 0; c < CHAINS; c++)         \
                acc[c] = STEP(acc[c], a, b);                                  \
            __asm__ volatile("" : "+v"(a), "+v"(b));                          \
        }                                                                     \
        ACC s = acc[0];                                                       \
        for (int c = 1; c < CHAINS; c++) s = ADD(s, acc[c]);                  \
        float out[LANES];                                                     \
        STORE(out, s);                                                        \
        return out[0];                                                        \
    }
PEAK_FORM(run_zmm, __m512, __m512bh, _mm512_set1_ps, (__m512bh)_mm512_set1_epi32(0x3f803f80),
          (__m512bh)_mm512_set1_epi32(0x3c003c00), _mm512_dpbf16_ps, _mm512_add_ps,
          _mm512_storeu_ps, 16)
PEAK_FORM(run_ymm, __m256, __m256bh, _mm256_set1_ps, (__m256bh)_mm256_set1_epi32(0x3f803f80),
          (__m256bh)_mm256_set1_epi32(0x3c003c00), _mm256_dpbf16_ps, _mm256_add_ps,
          _mm256_storeu_ps, 8)
PEAK_FORM(run_fma, __m512, __m512, _mm512_set1_ps, _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-7f),
          _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps, 16)
#undef PEAK_FORM

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 9;
    if (rounds < 1 || rounds > 1000) {
        fprintf(stderr, "rounds: 1 to 1000 (got %s)\n", argv[1]);
        return 2;
    }
    const char *names[3] = {"vdpbf16ps zmm", "vdpbf16ps ymm", "fp32 fma zmm"};
    const double flops_per[3] = {64, 32, 32};
    float (*forms[3])(float) = {run_zmm, run_ymm, run_fma};
    double *gflops = malloc(sizeof(double) * 3 * rounds);
    volatile float sink = 0;
    int threads = 1;
#pragma omp parallel
#pragma omp single
    threads = omp_get_num_threads();
    for (int r = 0; r < rounds; r++) {
        for (int f = 0; f < 3; f++) {
            double t0 = now_s();
#pragma omp parallel reduction(+ : sink)
            sink += forms[f]((float)omp_get_thread_num());
            double dt = now_s() - t0;
            gflops[f * rounds + r] = threads * (double)ITERS * CHAINS * flops_per[f] / dt / 1e9;
        }
    }
    printf("%d threads, %d rounds; GFLOP/s median (best)\n", threads, rounds);
    for (int f = 0; f < 3; f++) {
        double *g = gflops + f * rounds;
        qsort(g, rounds, sizeof(double), by_value);
        printf("%-14s %8.1f (%.1f)\n", names[f], g[rounds / 2], g[rounds - 1]);
    }
    free(gflops);
    if (sink == 12345.0f) puts(""); /* reads the sink: the sums are used */
    return 0;
}
