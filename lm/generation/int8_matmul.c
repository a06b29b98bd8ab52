/* int8 x int8 matmuls with exact int32 sums, for CPUs whose int8 dot-product instructions (AVX512-VNNI,
 * AMX) are missing: lm.generation.int8_native builds this file with the machine's C compiler on first use.
 *
 * y (M, N) = quantize(x) (M, K) . w (N, K)^T * x_scale (M) * w_scale (N), as lm.generation.quantize's
 * `dynamic` kernel computes it with torch._int_mm: each row of x rounded to its own int8 grid
 * (absmax / 127, half to even), the products summed exactly in int32, then scaled.
 *
 * Why not oneDNN's int8 GEMM (torch._int_mm) on AVX2: it shifts the activations to unsigned bytes
 * (0..255) for vpmaddubsw, whose int16 pair sums then saturate (2 * 255 * 127 > 32767). Here both
 * operands stay in -127..127 and the sign moves from x to w (|x| is unsigned, w takes x's sign), so a
 * pair sums to at most 2 * 127 * 127 = 32258: vpmaddubsw cannot saturate and every sum is exact. llama.cpp's
 * Q8_0 dot product on AVX2 multiplies the same way.
 *
 * Exact up to K = 133,000 (127 * 127 * K must fit an int32). Where the compiler targets no AVX2 the
 * plain loops below do the same arithmetic (and the compiler vectorises them as it can). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* One row of x (K floats) onto its int8 grid; returns the row's scale. The same float32 arithmetic as
 * quantize_per_channel: absmax / 127 (1 for a zero row), each value divided by it, rounded half to even
 * (the default rounding mode), clamped to -127..127. */
static float quantize_row(const float *x, int8_t *q, int64_t K) {
    float absmax = 0.0f;
    for (int64_t k = 0; k < K; k++) absmax = fmaxf(absmax, fabsf(x[k]));
    const float scale = absmax > 0.0f ? absmax / 127.0f : 1.0f;
    for (int64_t k = 0; k < K; k++) {
        float r = nearbyintf(x[k] / scale);
        q[k] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
    }
    return scale;
}

/* sum_k a[k] * b[k] over int8 values in -127..127, exact in int32: the plain loop, for the rows and
 * features the blocked loops below leave over. */
static int32_t dot_int8_plain(const int8_t *a, const int8_t *b, int64_t from, int64_t K) {
    int32_t sum = 0;
    for (int64_t k = from; k < K; k++) sum += (int32_t)a[k] * (int32_t)b[k];
    return sum;
}

#if defined(__AVX2__)
/* The 8 int32 lanes of each of four accumulators summed: (a, b, c, d) -> their four totals. */
static __m128i sum_lanes4(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);  /* pairs of lanes, per 128-bit half */
    __m256i abcd = _mm256_hadd_epi32(ab, cd);  /* each half: a, b, c, d partial sums */
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

/* One 32-byte block of products, pair-summed to 8 int32 lanes: |a| as unsigned bytes times b with a's
 * sign, so each int16 pair sum is at most 2 * 127 * 127 and vpmaddubsw cannot saturate. */
static inline __m256i block_products(__m256i a_abs, __m256i a, __m256i b, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a_abs, _mm256_sign_epi8(b, a)), ones);
}
#endif

/* How far ahead of the four rows being read the weights are asked for (_mm_prefetch, which never faults,
 * so reading past the last row is harmless). A decoding step reads each weight once, and between two
 * matmuls the rest of the step runs, so the rows come from L3 or memory: asking for them 6 KiB ahead
 * made one step's 25 matmuls 1.6-1.7x faster with their weights in L3 and 1.2-1.4x from memory (reference shape,
 * one thread, held to AVX2; 1.5 to 12 KiB ahead all gained about as much). */
#define PREFETCH_BYTES 6144

/* Four weight rows (w, w + K, w + 2K, w + 3K) against one quantized row a (and |a|, a_abs): the four
 * exact sums. The block of a is loaded once for all four rows, whose accumulators are summed together
 * at the end. */
static void dot4_int8(const int8_t *a, const uint8_t *a_abs, const int8_t *w, int64_t K, int32_t *sums) {
    int64_t k = 0;
#if defined(__AVX2__)
    const char *ahead = (const char *)w + PREFETCH_BYTES;
#endif
    int32_t total[4] = {0, 0, 0, 0};
#if defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (; k + 32 <= K; k += 32) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a + k));
        const __m256i x_abs = _mm256_loadu_si256((const __m256i *)(a_abs + k));
        _mm_prefetch(ahead + 4 * k, _MM_HINT_T0);  /* this block's 4 x 32 bytes, PREFETCH_BYTES further on */
        _mm_prefetch(ahead + 4 * k + 64, _MM_HINT_T0);
        acc0 = _mm256_add_epi32(acc0, block_products(x_abs, x, _mm256_loadu_si256((const __m256i *)(w + k)), ones));
        acc1 = _mm256_add_epi32(acc1, block_products(x_abs, x, _mm256_loadu_si256((const __m256i *)(w + K + k)),
                                                     ones));
        acc2 = _mm256_add_epi32(acc2, block_products(x_abs, x,
                                                     _mm256_loadu_si256((const __m256i *)(w + 2 * K + k)), ones));
        acc3 = _mm256_add_epi32(acc3, block_products(x_abs, x,
                                                     _mm256_loadu_si256((const __m256i *)(w + 3 * K + k)), ones));
    }
    _mm_storeu_si128((__m128i *)total, sum_lanes4(acc0, acc1, acc2, acc3));
#else
    (void)a_abs;
#endif
    for (int r = 0; r < 4; r++) sums[r] = total[r] + dot_int8_plain(a, w + r * K, k, K);
}

/* One weight row against one quantized row: the exact sum (the rows left over from blocks of four). */
static int32_t dot_int8(const int8_t *a, const uint8_t *a_abs, const int8_t *w, int64_t K) {
    int64_t k = 0;
    int32_t total = 0;
#if defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (; k + 32 <= K; k += 32)
        acc = _mm256_add_epi32(acc, block_products(_mm256_loadu_si256((const __m256i *)(a_abs + k)),
                                                   _mm256_loadu_si256((const __m256i *)(a + k)),
                                                   _mm256_loadu_si256((const __m256i *)(w + k)), ones));
    const __m256i zero = _mm256_setzero_si256();
    total = _mm_cvtsi128_si32(sum_lanes4(acc, zero, zero, zero));
#else
    (void)a_abs;
#endif
    return total + dot_int8_plain(a, w, k, K);
}

/* The kernel: returns 0, or 1 where its scratch memory could not be had (nothing written then).
 * x (M, K) float32, w (N, K) int8, w_scale (N) float32, y (M, N) float32, all contiguous. */
int lm_int8_linear(const float *x, const int8_t *w, const float *w_scale, float *y,
                   int64_t M, int64_t N, int64_t K, int threads) {
    int8_t *xq = malloc((size_t)(M * K));
    uint8_t *xq_abs = malloc((size_t)(M * K));
    float *x_scale = malloc((size_t)M * sizeof(float));
    if (xq == NULL || xq_abs == NULL || x_scale == NULL) {
        free(xq);
        free(xq_abs);
        free(x_scale);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) {
        x_scale[m] = quantize_row(x + m * K, xq + m * K, K);
        for (int64_t k = m * K; k < (m + 1) * K; k++) xq_abs[k] = (uint8_t)(xq[k] < 0 ? -xq[k] : xq[k]);
    }
    /* Output features split across threads in blocks of four rows: each thread reads its share of w once,
     * all M rows of x against each block while it is in L1. The order of dynamic's
     * (acc * x_scale) * w_scale, so the two agree to the last bit. */
    const int64_t blocks = N / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = 4 * b;
        int32_t sums[4];
        for (int64_t m = 0; m < M; m++) {
            dot4_int8(xq + m * K, xq_abs + m * K, w + n * K, K, sums);
            for (int r = 0; r < 4; r++) y[m * N + n + r] = (float)sums[r] * x_scale[m] * w_scale[n + r];
        }
    }
    for (int64_t n = 4 * blocks; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = (float)dot_int8(xq + m * K, xq_abs + m * K, w + n * K, K) * x_scale[m] * w_scale[n];
    free(xq);
    free(xq_abs);
    free(x_scale);
    return 0;
}
