/* quant_x8.c's products on AVX-512 VNNI: a weight pair's 64 bytes in one register, dotted with
 * the activations' 64 by one multiply-add (vpdpbusd) a row. */
#include "quant_x8.h"

#if defined(QUANT_X8_AVX512)
#include "k_scales.h"

/* Activation rows dotted with each weight row in one pass (accumulators held in registers). */
#define MAX_ROWS 8

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

#define REST_CASES(QTYPE, BYTES)                                                                       \
    DOT_ROWS_CASE(QTYPE, BYTES, 1) DOT_ROWS_CASE(QTYPE, BYTES, 2) DOT_ROWS_CASE(QTYPE, BYTES, 3)      \
    DOT_ROWS_CASE(QTYPE, BYTES, 4) DOT_ROWS_CASE(QTYPE, BYTES, 5) DOT_ROWS_CASE(QTYPE, BYTES, 6)      \
    DOT_ROWS_CASE(QTYPE, BYTES, 7)
X8_KERNELS
#endif
