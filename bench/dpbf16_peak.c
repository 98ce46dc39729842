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

/* Each returns a value read from every accumulator so that the compiler keeps every
 * instruction. */
static float run_zmm(float seed) {
    __m512 acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps(seed + c);
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    for (long i = 0; i < ITERS; i++) {
#pragma GCC unroll 24
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
        __asm__ volatile("" : "+v"(a), "+v"(b));
    }
    __m512 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}

static float run_ymm(float seed) {
    __m256 acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps(seed + c);
    __m256bh a = (__m256bh)_mm256_set1_epi32(0x3f803f80), b = (__m256bh)_mm256_set1_epi32(0x3c003c00);
    for (long i = 0; i < ITERS; i++) {
#pragma GCC unroll 24
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_dpbf16_ps(acc[c], a, b);
        __asm__ volatile("" : "+v"(a), "+v"(b));
    }
    __m256 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm256_add_ps(s, acc[c]);
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[7];
}

static float run_fma(float seed) {
    __m512 acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps(seed + c);
    __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    for (long i = 0; i < ITERS; i++) {
#pragma GCC unroll 24
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
        __asm__ volatile("" : "+v"(a), "+v"(b));
    }
    __m512 s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}

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
