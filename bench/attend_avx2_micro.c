/* The AVX2 decode attention alone, in C: ns a key and KV head, no Python between calls.
 * It includes the engine's decode_ops.c (SRC: that file, or an earlier commit's copy) and calls
 * its AVX2 kernel for head size 64 over bf16 caches, as one decode step of one sequence would:
 * each of `layers` layers its own cache (4 MB at 4,000 keys, so 12 of them come from memory),
 * every KV head in turn. Build for an AVX2-only CPU's target (or -march=native on one):
 *   gcc -O3 -march=x86-64-v3 -I. -DSRC='"src/pdscope/engine/csrc/decode_ops.c"' \
 *       bench/attend_avx2_micro.c -o /tmp/attend_micro -lm
 * (an earlier commit's copy: git show REV:src/pdscope/engine/csrc/decode_ops.c > /tmp/before.c
 * and -DSRC='"/tmp/before.c"' for a second binary, run in turn with the first)
 *   /tmp/attend_micro 4000 30            # keys, repeats (best of), 4 query heads a KV head
 *   /tmp/attend_micro 1024 3000 4 1      # one layer of 1,024 keys: the KV in cache
 *   SHUF=1 /tmp/attend_micro 4000 30     # the blocks of the table shuffled
 * Arguments: keys, repeats, query heads a KV head (4), layers (12), block size (16); read
 * from argv so the compiler cannot fold them into the kernel. Prints the best repeat's ms,
 * ns a key and KV head, GB/s of K and V, and a checksum of the outputs (the same for two
 * builds whose arithmetic is the same). Two at once (one per core) stand in for the engine's
 * two threads, each attending its own KV heads. */
#include SRC
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef HAVE_AVX2_BF16
#error "the AVX2 decode attention: build with -march=x86-64-v3, or natively on an AVX2-only CPU"
#endif

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int keys = argc > 1 ? atoi(argv[1]) : 4000, repeats = argc > 2 ? atoi(argv[2]) : 30;
    const int group = argc > 3 ? atoi(argv[3]) : 4, layers = argc > 4 ? atoi(argv[4]) : 12;
    const int64_t block = argc > 5 ? atoi(argv[5]) : 16, kv_heads = 4, dim = 64;
    if (keys < 1 || repeats < 1 || group < 1 || layers < 1 || block < 1) {
        fprintf(stderr, "usage: %s [keys repeats group layers block_size], all positive\n",
                argv[0]);
        return 2;
    }
    const int64_t blocks = (keys + block - 1) / block, slots = blocks * block;
    bf16 **kv = malloc(sizeof(bf16 *) * (size_t)layers);
    for (int L = 0; L < layers; L++) {
        const int64_t n = 2 * kv_heads * slots * dim;
        /* on 64-byte lines, as torch allocates the engine's caches: rows 16 bytes off them
         * (malloc's) took fdf004d's kernel 29.7 ns a key and KV head, not 45 */
        kv[L] = aligned_alloc(64, (size_t)n * sizeof(bf16));
        for (int64_t i = 0; i < n; i++)
            kv[L][i] = f32_to_bf16((float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f);
    }
    int64_t *table = malloc(sizeof(int64_t) * (size_t)blocks);
    for (int64_t b = 0; b < blocks; b++) table[b] = b;
    if (getenv("SHUF")) {
        srand(1);
        for (int64_t b = blocks - 1; b > 0; b--) {
            const int64_t j = rand() % (b + 1), t = table[b];
            table[b] = table[j];
            table[j] = t;
        }
    }
    float *q = malloc(sizeof(float) * (size_t)(group * dim));
    float *m = malloc(sizeof(float) * (size_t)group), *l = malloc(sizeof(float) * (size_t)group);
    float *acc = malloc(sizeof(float) * (size_t)(group * dim));
    for (int i = 0; i < group * dim; i++) q[i] = (float)((i * 37) % 17) / 17.0f - 0.5f;
    double best = 1e9, checksum = 0.0;
    for (int r = 0; r < repeats; r++) {
        const double t0 = now_s();
        for (int L = 0; L < layers; L++)
            for (int64_t h = 0; h < kv_heads; h++) {
                attend_avx2_64_1(q, group, kv[L], kv_heads, slots, h, table, block, 0, keys, m,
                                 l, acc);
                if (r == 0) checksum += acc[3] / l[0];
            }
        const double t = now_s() - t0;
        best = t < best ? t : best;
    }
    const double key_heads = (double)keys * kv_heads * layers;
    printf("%d keys: %.3f ms, %.1f ns a key and KV head, %.1f GB/s of K and V (checksum %.6g)\n",
           keys, best * 1e3, best * 1e9 / key_heads, key_heads * dim * 2 * 2 / best / 1e9,
           checksum);
    return 0;
}
