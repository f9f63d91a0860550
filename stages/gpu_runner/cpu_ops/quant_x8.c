/* The decode step's products with 8-bit activations: out[j, r] = x[j] . W[r] for a few rows x[j],
 * W[r] one row of GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) kept as the file stores them.
 *
 * Each activation row is first cut into blocks of 32 values and each block quantized to 8 bits, as
 * llama.cpp does: d = max|x| / 127, q = x / d rounded to nearest, so |x - d q| <= d / 2. A block's
 * dot is then taken in integers and scaled once by the weight's and the activation's scales
 * (quant_x8_avx512.c: VNNI, 64 byte products a multiply-add; quant_x8_avx2.c: 32 a multiply-add
 * pair). Decoding a block costs a handful of byte operations where the float32 kernel (quant.c)
 * widens every value to a float: one stream of a Q4_1 model is bound by that decoding, not by
 * reading the blocks.
 *
 * The price is the activations' rounding: a block's dot moves by at most d / 2 times the sum of its
 * weights' magnitudes (tests/gpu_runner/test_quant_x8.py checks that bound). The float32 kernel stays
 * the exact one and the default (`--quantized-activations float32`).
 *
 * The activations are quantized the same way, to the bit, on both instruction sets. Without AVX-512
 * VNNI or AVX2 (with FMA and F16C), quant_x8_available() is 0 and nothing here is called.
 */
#include <stdlib.h>

#include "kernels.h"
#include "quant_x8.h"

int quant_x8_available(int qtype) {
#if defined(QUANT_X8)
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || is_k_type(qtype);
#else
    (void)qtype;
    return 0;
#endif
}

#if defined(QUANT_X8)
/* 32 values of x to 8 bits: q (as 16 + 16 bytes at q0 and q1, and q + 128 at u0 and u1), its scale
 * in *d and d * sum(q) in *s. Rounding is the CPU's default, to nearest even, on both paths. */
static void quantize_block(const float *x, int8_t *q0, int8_t *q1, uint8_t *u0, uint8_t *u1, float *d_out,
                           float *s_out) {
    const __m128i bias = _mm_set1_epi8((char)0x80);
#if defined(QUANT_X8_AVX512)
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
    const __m128i ba = _mm512_cvtsepi32_epi8(qa), bb = _mm512_cvtsepi32_epi8(qb);
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
    __m256 v[4];
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    /* packs interleaves the 128-bit lanes; the permute puts the 32 bytes back in order */
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m128i ba = _mm256_castsi256_si128(bytes), bb = _mm256_extracti128_si256(bytes, 1);
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    const int sum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
#endif
    _mm_storeu_si128((__m128i *)q0, ba);
    _mm_storeu_si128((__m128i *)q1, bb);
    _mm_storeu_si128((__m128i *)u0, _mm_xor_si128(ba, bias));
    _mm_storeu_si128((__m128i *)u1, _mm_xor_si128(bb, bias));
    *d_out = d;
    *s_out = d * (float)sum;
}

/* Row x [cols] into ceil(cols / 64) pairs (a last lone block paired with zeros), in the weight's order. */
static void quantize_row(const float *x, int64_t cols, int nibble_order, pair8 *out) {
    const int64_t blocks = cols / 32;
    for (int64_t p = 0; p < (blocks + 1) / 2; p++) {
        pair8 *pair = out + p;
        memset(pair->q, 0, sizeof pair->q);
        memset(pair->u, 0x80, sizeof pair->u);
        float d[2] = {0.0f, 0.0f}, s[2] = {0.0f, 0.0f};
        for (int half = 0; half < 2 && 2 * p + half < blocks; half++) {
            const int first = nibble_order ? 16 * half : 32 * half;
            const int second = nibble_order ? 32 + 16 * half : 32 * half + 16;
            quantize_block(x + (2 * p + half) * 32, pair->q + first, pair->q + second, pair->u + first,
                           pair->u + second, &d[half], &s[half]);
        }
        for (int lane = 0; lane < 16; lane++) pair->d[lane] = d[nibble_order ? (lane / 4) & 1 : lane / 8];
        pair->s[0] = pair->s[2] = 0.0f;
        pair->s[1] = s[0];
        pair->s[3] = s[1];
    }
}

/* Blocks read this far ahead of the row being multiplied (as quant.c does, and for the same reason). */
#define PREFETCH_AHEAD 4096

typedef struct {
    const uint8_t *blocks;
    int qtype;
    int64_t row_bytes, rows, blocks_per_row, pairs, n;
    const pair8 *quantized;
    float *out;
} x8_job;

/* Rows [begin, end) of a product: one thread's chunk. */
static void x8_rows(void *job_pointer, int64_t begin, int64_t end) {
    const x8_job *j = job_pointer;
    for (int64_t r = begin; r < end; r++) {
        const uint8_t *row = j->blocks + r * j->row_bytes;
        for (int64_t at = 0; at < j->row_bytes; at += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + at, _MM_HINT_T0);
        x8_row_products(row, j->qtype, j->blocks_per_row, j->quantized, j->pairs, j->n, j->out + r, j->rows);
    }
}
#endif

/* out [n, rows] = x [n, cols] times the weight [rows, cols] transposed, x quantized to 8 bits a block.
 * Returns 0, or -1 where the kernel is not built for this CPU or type (nothing written). */
int quant_matmul_x8(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t rows, int64_t cols, const float *x,
                    int64_t n, float *out) {
#if defined(QUANT_X8)
    if (!quant_x8_available(qtype)) return -1;
    const int64_t blocks_per_row = cols / 32, pairs = (blocks_per_row + 1) / 2;
    pair8 *quantized = aligned_alloc(64, sizeof(pair8) * (size_t)(pairs * n));
    if (quantized == NULL) abort(); /* n rows of cols bytes and scales: a few KiB */
    for (int64_t j = 0; j < n; j++) quantize_row(x + j * cols, cols, qtype != Q8_0 && !is_k_type(qtype), quantized + j * pairs);
    x8_job job = {blocks, qtype, row_bytes, rows, blocks_per_row, pairs, n, quantized, out};
    pool_enter();
    pool_run(x8_rows, &job, rows, pool_grain(rows, 64));
    pool_leave();
    free(quantized);
    return 0;
#else
    (void)blocks; (void)qtype; (void)row_bytes; (void)rows; (void)cols; (void)x; (void)n; (void)out;
    return -1;
#endif
}
