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

/* sum_k a[k] * b[k] over int8 values in -127..127, exact in int32. */
static int32_t dot_int8(const int8_t *a, const int8_t *b, int64_t K) {
    int64_t k = 0;
    int32_t sum = 0;
#if defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();  /* two chains: the adds overlap */
    for (; k + 64 <= K; k += 64) {
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(a + k)), b0 = _mm256_loadu_si256((const __m256i *)(b + k));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(a + k + 32));
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + k + 32));
        /* |a| as unsigned bytes times b with a's sign: pairs of products in int16, then in int32 */
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a0, a0),
                                                                           _mm256_sign_epi8(b0, a0)), ones));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a1, a1),
                                                                           _mm256_sign_epi8(b1, a1)), ones));
    }
    for (; k + 32 <= K; k += 32) {
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(a + k)), b0 = _mm256_loadu_si256((const __m256i *)(b + k));
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a0, a0),
                                                                           _mm256_sign_epi8(b0, a0)), ones));
    }
    __m256i acc = _mm256_add_epi32(acc0, acc1);  /* 8 int32 lanes -> 1 */
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    sum = _mm_cvtsi128_si32(s);
#endif
    for (; k < K; k++) sum += (int32_t)a[k] * (int32_t)b[k];
    return sum;
}

/* The kernel: returns 0, or 1 where its scratch memory could not be had (nothing written then).
 * x (M, K) float32, w (N, K) int8, w_scale (N) float32, y (M, N) float32, all contiguous. */
int lm_int8_linear(const float *x, const int8_t *w, const float *w_scale, float *y,
                   int64_t M, int64_t N, int64_t K, int threads) {
    int8_t *xq = malloc((size_t)(M * K));
    float *x_scale = malloc((size_t)M * sizeof(float));
    if (xq == NULL || x_scale == NULL) {
        free(xq);
        free(x_scale);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) x_scale[m] = quantize_row(x + m * K, xq + m * K, K);
    /* Output features split across threads: each reads its share of w once, all M rows against each
     * weight row while it is in L1. */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *w_row = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            /* the order of dynamic's (acc * x_scale) * w_scale, so the two agree to the last bit */
            y[m * N + n] = (float)dot_int8(xq + m * K, w_row, K) * x_scale[m] * w_scale[n];
        }
    }
    free(xq);
    free(x_scale);
    return 0;
}
