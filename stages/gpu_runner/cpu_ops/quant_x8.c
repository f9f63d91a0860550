/* The decode step's products with 8-bit activations: out[j, r] = x[j] . W[r] for a few rows x[j],
 * W[r] one row of GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) kept as the file stores them.
 *
 * Each activation row is first cut into blocks of 32 values and each block quantized to 8 bits, as
 * llama.cpp does: d = max|x| / 127, q = x / d rounded to nearest, so |x - d q| <= d / 2. A block's
 * dot is then taken in integers (AVX-512 VNNI: 64 byte products a multiply-add, two blocks at once)
 * and scaled once by the weight's and the activation's scales. Decoding a block costs a handful of
 * byte operations where the float32 kernel (quant.c) widens every value to a float: one stream of a
 * Q4_1 model is bound by that decoding, not by reading the blocks.
 *
 * The price is the activations' rounding: a block's dot moves by at most d / 2 times the sum of its
 * weights' magnitudes (tests/gpu_runner/test_quant_x8.py checks that bound). The float32 kernel stays
 * the exact one and the default (`--quantized-activations float32`).
 *
 * Without AVX-512 VNNI and BW, quant_x8_available() is 0 and nothing here is called.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k_scales.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define QUANT_X8 1
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline int is_k_type(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }

int quant_x8_available(int qtype) {
#if defined(QUANT_X8)
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || is_k_type(qtype);
#else
    (void)qtype;
    return 0;
#endif
}

#if defined(QUANT_X8)
/* Two blocks of one activation row, quantized: their 64 values q (u = q + 128: the unsigned operand
 * for the signed weight types), each block's scale d spread over the lanes its products land in,
 * and s = [0, d0 sum(q0), 0, d1 sum(q1)] (the _1 types' minimum multiplies it). The values are laid
 * out as the weight's bytes are decoded: for the 4- and 5-bit types, whose block holds values i and
 * i + 16 in one byte, block 0's values 0-15, block 1's 0-15, block 0's 16-31, block 1's 16-31 (so
 * lanes 0-3 and 8-11 of a product are block 0's); for Q8_0, block 0 then block 1. */
typedef struct {
    int8_t q[64];
    uint8_t u[64];
    float d[16];
    float s[4];
} pair8;

/* 32 values of x to 8 bits: q (as 16 + 16 bytes at q0 and q1), its scale in *d and d * sum(q) in *s. */
static void quantize_block(const float *x, int8_t *q0, int8_t *q1, uint8_t *u0, uint8_t *u1, float *d_out,
                           float *s_out) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
    const __m128i ba = _mm512_cvtsepi32_epi8(qa), bb = _mm512_cvtsepi32_epi8(qb), bias = _mm_set1_epi8((char)0x80);
    _mm_storeu_si128((__m128i *)q0, ba);
    _mm_storeu_si128((__m128i *)q1, bb);
    _mm_storeu_si128((__m128i *)u0, _mm_xor_si128(ba, bias));
    _mm_storeu_si128((__m128i *)u1, _mm_xor_si128(bb, bias));
    *d_out = d;
    *s_out = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
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

/* Activation rows dotted with each weight row in one pass (accumulators held in registers). */
#define MAX_ROWS 8

static inline int signed_type(int qtype) { return qtype == Q8_0 || qtype == Q4_0 || qtype == Q5_0; }
static inline int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }

/* The first 4 bytes of a block: its float16 scale, and the minimum of the _1 types. */
static inline uint32_t head(const uint8_t *b) {
    uint32_t word;
    memcpy(&word, b, 4);
    return word;
}

/* Two weight blocks b0 and b0 + bytes (the second absent where lone) as 64 bytes in pair8's order,
 * and [d0, m0, d1, m1] (the minimums of the _1 types; other lanes unused) in *scales. */
static inline __attribute__((always_inline)) __m512i weight_pair(const uint8_t *b0, const int qtype, const int bytes,
                                                                 const int lone, __m128 *scales) {
    const uint8_t *b1 = b0 + bytes;
    *scales = _mm_cvtph_ps(_mm_set_epi32(0, 0, lone ? 0 : (int)head(b1), (int)head(b0)));
    if (qtype == Q8_0) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(b0 + 2));
        return lone ? _mm512_zextsi256_si512(w0)
                    : _mm512_inserti64x4(_mm512_castsi256_si512(w0), _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
    }
    const int qs = qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8;
    const __m128i low_half = _mm_loadu_si128((const __m128i *)(b0 + qs));
    const __m256i raw = lone ? _mm256_zextsi128_si256(low_half)
                             : _mm256_inserti128_si256(_mm256_castsi128_si256(low_half),
                                                       _mm_loadu_si128((const __m128i *)(b1 + qs)), 1);
    const __m256i mask = _mm256_set1_epi8(0xf);
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, mask)),
                                   _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask), 1);
    if (qtype == Q4_0) return _mm512_sub_epi8(w, _mm512_set1_epi8(8));
    if (qtype == Q5_0 || qtype == Q5_1) { /* the fifth bit of value i is bit i of the block's qh */
        uint32_t h0, h1 = 0;
        memcpy(&h0, b0 + qs - 4, 4);
        if (!lone) memcpy(&h1, b1 + qs - 4, 4);
        const __mmask64 high = (uint64_t)(h0 & 0xffffu) | (uint64_t)(h1 & 0xffffu) << 16 |
                               (uint64_t)(h0 >> 16) << 32 | (uint64_t)(h1 >> 16) << 48;
        w = _mm512_mask_add_epi8(w, high, w, _mm512_set1_epi8(16));
        if (qtype == Q5_0) w = _mm512_sub_epi8(w, _mm512_set1_epi8(16));
    }
    return w;
}

/* The weight's 64 values w (in pair8's order) times pair p of x[j], for j < m, added into acc[j]:
 * the products of lanes l scaled by wd[l] and the activations' d; mins[j] += minimums * x's s (the
 * types with a minimum). Signed weights are multiplied with u = q + 128, the sum starting at
 * -128 sum(w), so the unsigned-by-signed multiply-add gives sum(q w); unsigned weights take q. */
static inline __attribute__((always_inline)) void accumulate(const __m512i w, const __m512 wd, const __m128 minimums,
                                                             const int is_signed, const int with_min, const pair8 *x,
                                                             int64_t pairs, const int m, __m512 acc[MAX_ROWS],
                                                             __m128 mins[MAX_ROWS]) {
    __m512i start = _mm512_setzero_si512();
    if (is_signed) start = _mm512_sub_epi32(start, _mm512_dpbusd_epi32(start, _mm512_set1_epi8((char)0x80), w));
    for (int j = 0; j < m; j++) {
        const pair8 *xp = x + j * pairs;
        const __m512i dot = is_signed ? _mm512_dpbusd_epi32(start, _mm512_loadu_si512(xp->u), w)
                                      : _mm512_dpbusd_epi32(start, w, _mm512_loadu_si512(xp->q));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wd, _mm512_loadu_ps(xp->d)), acc[j]);
        if (with_min) mins[j] = _mm_fmadd_ps(minimums, _mm_loadu_ps(xp->s), mins[j]);
    }
}

/* Two blocks of a 32-value type from b0 (one where lone) times pair p of x[j], for j < m. */
static inline __attribute__((always_inline)) void pair_dot(const uint8_t *b0, const int qtype, const int bytes,
                                                           const int lone, const pair8 *x, int64_t pairs,
                                                           const int m, __m512 acc[MAX_ROWS], __m128 mins[MAX_ROWS]) {
    __m128 scales;
    const __m512i w = weight_pair(b0, qtype, bytes, lone, &scales);
    const __m512i lanes = qtype == Q8_0 ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                                        : _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
    accumulate(w, _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(scales)), scales, signed_type(qtype),
               has_min(qtype), x, pairs, m, acc, mins);
}

/* A 256-value block (Q4_K, Q5_K, Q6_K) at b times its four pairs of x[j] (from x), for j < m.
 * Q4_K/Q5_K: 64-value chunk c holds sub-blocks 2c (low nibbles of its 32 bytes) and 2c + 1 (high
 * nibbles), each with a 6-bit scale and minimum; Q6_K: half h's 64 bytes of low bits and 32 of high
 * bits hold chunks 2h (low nibbles) and 2h + 1 (high nibbles), with a scale per 16 values. */
static inline __attribute__((always_inline)) void block256_dot(const uint8_t *b, const int qtype, const pair8 *x,
                                                               int64_t pairs, const int m, __m512 acc[MAX_ROWS],
                                                               __m128 mins[MAX_ROWS]) {
    const __m256i nibble = _mm256_set1_epi8(0xf);
    if (qtype == Q6_K) {
        const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
                                            _mm512_set1_ps(_cvtsh_ss((uint16_t)(b[208] | (b[209] << 8)))));
        for (int c = 0; c < 4; c++) {
            const int half = c / 2, high_nibbles = c % 2;
            const __m512i ql = _mm512_loadu_si512(b + 64 * half);
            const __m512i low = _mm512_and_si512(high_nibbles ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0xf));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half)), two = _mm256_set1_epi8(0x30);
            /* bits 2 * part .. 2 * part + 1 of qh, moved to bits 4-5: parts 0, 1 (c even) or 2, 3 */
            const __m256i h0 = _mm256_and_si256(high_nibbles ? qh : _mm256_slli_epi16(qh, 4), two);
            const __m256i h1 = _mm256_and_si256(high_nibbles ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 2), two);
            const __m512i q = _mm512_or_si512(low, _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1));
            const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(4 * c),
                                                   _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
            accumulate(_mm512_sub_epi8(q, _mm512_set1_epi8(32)), _mm512_permutexvar_ps(lanes, scales),
                       _mm_setzero_ps(), 1, 0, x + c, pairs, m, acc, mins);
        }
        return;
    }
    float scale[8], minimum[8];
    k_scales_of(b, _cvtsh_ss((uint16_t)(b[0] | (b[1] << 8))), _cvtsh_ss((uint16_t)(b[2] | (b[3] << 8))), scale, minimum);
    const __m512 scales = _mm512_castps256_ps512(_mm256_loadu_ps(scale));
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48);
    for (int c = 0; c < 4; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, nibble)),
                                       _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), 1);
        if (qtype == Q5_K) { /* the fifth bit of sub-block j's value i is bit j of qh[i] */
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            const __mmask64 high = (uint64_t)_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * c)))) |
                                   (uint64_t)_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * c + 1)))) << 32;
            q = _mm512_mask_add_epi8(q, high, q, _mm512_set1_epi8(16));
        }
        const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(2 * c),
                                               _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
        accumulate(q, _mm512_permutexvar_ps(lanes, scales),
                   _mm_set_ps(-minimum[2 * c + 1], 0.0f, -minimum[2 * c], 0.0f), 0, 1, x + c, pairs, m, acc, mins);
    }
}

/* out[j * out_stride] = x[j] . the row, for j < m (a constant where this is inlined). */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *row, const int qtype, const int bytes,
                                                           int64_t blocks, const pair8 *x, int64_t pairs,
                                                           const int m, float *out, int64_t out_stride) {
    __m512 acc[MAX_ROWS];
    __m128 mins[MAX_ROWS];
    for (int j = 0; j < m; j++) {
        acc[j] = _mm512_setzero_ps();
        mins[j] = _mm_setzero_ps();
    }
    if (is_k_type(qtype)) {
        for (int64_t k = 0; k < blocks / 8; k++) block256_dot(row + k * bytes, qtype, x + 4 * k, pairs, m, acc, mins);
    } else {
        int64_t p = 0;
        for (; p < blocks / 2; p++) pair_dot(row + 2 * p * bytes, qtype, bytes, 0, x + p, pairs, m, acc, mins);
        if (blocks & 1) pair_dot(row + 2 * p * bytes, qtype, bytes, 1, x + p, pairs, m, acc, mins);
    }
    for (int j = 0; j < m; j++) {
        const __m128 pairs_of = _mm_add_ps(mins[j], _mm_movehl_ps(mins[j], mins[j]));
        out[j * out_stride] = _mm512_reduce_add_ps(acc[j]) + _mm_cvtss_f32(_mm_add_ss(pairs_of, _mm_shuffle_ps(pairs_of, pairs_of, 1)));
    }
}

#define DOT_ROWS_CASE(QTYPE, BYTES, M)                                                                         \
    case M: dot_rows(row, QTYPE, BYTES, blocks, x + j0 * pairs, pairs, M, out + j0 * out_stride, out_stride); break;
#define DOT_ROWS_OF(QTYPE, BYTES)                                                                                    \
    static void dot_rows_##QTYPE(const uint8_t *row, int64_t blocks, const pair8 *x, int64_t pairs, int64_t n,    \
                                 float *out, int64_t out_stride) {                                                \
        int64_t j0 = 0;                                                                                           \
        for (; j0 + MAX_ROWS <= n; j0 += MAX_ROWS)                                                                \
            dot_rows(row, QTYPE, BYTES, blocks, x + j0 * pairs, pairs, MAX_ROWS, out + j0 * out_stride, out_stride); \
        switch (n - j0) {                                                                                         \
            DOT_ROWS_CASE(QTYPE, BYTES, 1) DOT_ROWS_CASE(QTYPE, BYTES, 2) DOT_ROWS_CASE(QTYPE, BYTES, 3)          \
            DOT_ROWS_CASE(QTYPE, BYTES, 4) DOT_ROWS_CASE(QTYPE, BYTES, 5) DOT_ROWS_CASE(QTYPE, BYTES, 6)          \
            DOT_ROWS_CASE(QTYPE, BYTES, 7)                                                                        \
        }                                                                                                         \
    }
DOT_ROWS_OF(Q8_0, 34)
DOT_ROWS_OF(Q4_0, 18)
DOT_ROWS_OF(Q4_1, 20)
DOT_ROWS_OF(Q5_0, 22)
DOT_ROWS_OF(Q5_1, 24)
DOT_ROWS_OF(Q4_K, 144)
DOT_ROWS_OF(Q5_K, 176)
DOT_ROWS_OF(Q6_K, 210)

/* Blocks read this far ahead of the row being multiplied (as quant.c does, and for the same reason). */
#define PREFETCH_AHEAD 4096
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
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = blocks + r * row_bytes;
        for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + at, _MM_HINT_T0);
        switch (qtype) {
        case Q8_0: dot_rows_Q8_0(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        case Q4_0: dot_rows_Q4_0(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        case Q4_1: dot_rows_Q4_1(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        case Q5_0: dot_rows_Q5_0(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        case Q5_1: dot_rows_Q5_1(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        case Q4_K: dot_rows_Q4_K(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        case Q5_K: dot_rows_Q5_K(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        default: dot_rows_Q6_K(row, blocks_per_row, quantized, pairs, n, out + r, rows); break;
        }
    }
    free(quantized);
    return 0;
#else
    (void)blocks; (void)qtype; (void)row_bytes; (void)rows; (void)cols; (void)x; (void)n; (void)out;
    return -1;
#endif
}
