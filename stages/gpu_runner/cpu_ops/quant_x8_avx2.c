/* quant_x8.c's products on AVX2: a weight pair's 64 bytes in two registers (lo: bytes 0-31, hi:
 * 32-63), each dotted with 32 activation bytes by a multiply-add pair (vpmaddubsw, vpmaddwd) that
 * leaves one 32-bit sum per 4 bytes, the lanes of quant_x8.h's layout. vpmaddubsw multiplies
 * unsigned by signed bytes and saturates its pair sums at 16 bits: the unsigned types (at most 31)
 * go in as they are; a signed weight w goes in as |w| with the activation given w's sign, so a
 * pair's sum stays within 2 * 128 * 127 < 2^15. */
#include "quant_x8.h"

#if defined(QUANT_X8_AVX2)
#include "avx2.h"
#include "k_scales.h"

/* Activation rows dotted with each weight row in one pass: 4, so that their accumulators and the
 * weight's registers fit AVX2's 16. */
#define MAX_ROWS 4

typedef struct {
    __m256i lo, hi;
} bytes64;

/* `w` with 16 added in the bytes `high` marks (their low four bits are below 16). */
static inline __m256i with_fifth_bit(__m256i w, __m256i high) {
    return _mm256_or_si256(w, _mm256_and_si256(high, _mm256_set1_epi8(16)));
}

/* Two weight blocks b0 and b0 + bytes (the second absent where lone) as 64 bytes in pair8's order,
 * and [d0, m0, d1, m1] (the minimums of the _1 types; other lanes unused) in *scales. */
static inline __attribute__((always_inline)) bytes64 weight_pair(const uint8_t *b0, const int qtype, const int bytes,
                                                                 const int lone, __m128 *scales) {
    const uint8_t *b1 = b0 + bytes;
    *scales = _mm_cvtph_ps(_mm_set_epi32(0, 0, lone ? 0 : (int)head(b1), (int)head(b0)));
    bytes64 w;
    if (qtype == Q8_0) {
        w.lo = _mm256_loadu_si256((const __m256i *)(b0 + 2));
        w.hi = lone ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(b1 + 2));
        return w;
    }
    const int qs = qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8;
    const __m128i low_half = _mm_loadu_si128((const __m128i *)(b0 + qs));
    const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(low_half),
                                                lone ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)(b1 + qs)), 1);
    const __m256i mask = _mm256_set1_epi8(0xf);
    w.lo = _mm256_and_si256(raw, mask);
    w.hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    if (qtype == Q4_0) {
        w.lo = _mm256_sub_epi8(w.lo, _mm256_set1_epi8(8));
        w.hi = _mm256_sub_epi8(w.hi, _mm256_set1_epi8(8));
    } else if (qtype == Q5_0 || qtype == Q5_1) { /* the fifth bit of value i is bit i of the block's qh */
        uint32_t h0, h1 = 0;
        memcpy(&h0, b0 + qs - 4, 4);
        if (!lone) memcpy(&h1, b1 + qs - 4, 4);
        w.lo = with_fifth_bit(w.lo, bytes_from_bits((h0 & 0xffffu) | (h1 & 0xffffu) << 16));
        w.hi = with_fifth_bit(w.hi, bytes_from_bits((h0 >> 16) | (h1 >> 16) << 16));
        if (qtype == Q5_0) {
            w.lo = _mm256_sub_epi8(w.lo, _mm256_set1_epi8(16));
            w.hi = _mm256_sub_epi8(w.hi, _mm256_set1_epi8(16));
        }
    }
    return w;
}

/* 32 weight bytes w times 32 activations q: a 32-bit sum per 4 bytes. */
static inline __attribute__((always_inline)) __m256i dot32(const __m256i w, const __m256i q, const int is_signed) {
    const __m256i pairs = is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w))
                                    : _mm256_maddubs_epi16(w, q);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* The weight's 64 values w (in pair8's order) times pair p of x[j], for j < m, added into acc[j]:
 * the sums of lanes l scaled by wd (lo, hi: lanes 0-7, 8-15) and the activations' d; mins[j] +=
 * minimums * x's s (the types with a minimum). Where lo's lanes and hi's hold the same blocks
 * (`same_blocks`: the 4- and 5-bit 32-value types; wd_hi is then wd_lo), their integer sums are
 * added first and scaled once. */
static inline __attribute__((always_inline)) void accumulate(const bytes64 w, const __m256 wd_lo, const __m256 wd_hi,
                                                             const __m128 minimums, const int is_signed,
                                                             const int with_min, const int same_blocks,
                                                             const pair8 *x, int64_t pairs, const int m,
                                                             __m256 acc[MAX_ROWS], __m128 mins[MAX_ROWS]) {
    for (int j = 0; j < m; j++) {
        const pair8 *xp = x + j * pairs;
        const __m256i lo = dot32(w.lo, _mm256_loadu_si256((const __m256i *)xp->q), is_signed);
        const __m256i hi = dot32(w.hi, _mm256_loadu_si256((const __m256i *)(xp->q + 32)), is_signed);
        if (same_blocks) {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)),
                                     _mm256_mul_ps(wd_lo, _mm256_loadu_ps(xp->d)), acc[j]);
        } else {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(wd_lo, _mm256_loadu_ps(xp->d)), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(wd_hi, _mm256_loadu_ps(xp->d + 8)), acc[j]);
        }
        if (with_min) mins[j] = _mm_fmadd_ps(minimums, _mm_loadu_ps(xp->s), mins[j]);
    }
}

/* Two blocks of a 32-value type from b0 (one where lone) times pair p of x[j], for j < m. */
static inline __attribute__((always_inline)) void pair_dot(const uint8_t *b0, const int qtype, const int bytes,
                                                           const int lone, const pair8 *x, int64_t pairs,
                                                           const int m, __m256 acc[MAX_ROWS], __m128 mins[MAX_ROWS]) {
    __m128 scales;
    const bytes64 w = weight_pair(b0, qtype, bytes, lone, &scales);
    const __m256 wide = _mm256_castps128_ps256(scales);
    if (qtype == Q8_0) /* block 0 in lo, block 1 in hi */
        accumulate(w, _mm256_permutevar8x32_ps(wide, _mm256_set1_epi32(0)),
                   _mm256_permutevar8x32_ps(wide, _mm256_set1_epi32(2)), scales, 1, 0, 0, x, pairs, m, acc, mins);
    else { /* lanes 0-3 block 0's, 4-7 block 1's, in lo and hi alike */
        const __m256 wd = _mm256_permutevar8x32_ps(wide, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
        accumulate(w, wd, wd, scales, signed_type(qtype), has_min(qtype), 1, x, pairs, m, acc, mins);
    }
}

/* [a x4, b x4] */
static inline __m256 two_scales(float a, float b) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(a)), _mm_set1_ps(b), 1);
}

/* A 256-value block (Q4_K, Q5_K, Q6_K) at b times its four pairs of x[j] (from x), for j < m, laid
 * out as in quant_x8_avx512.c's block256_dot. */
static inline __attribute__((always_inline)) void block256_dot(const uint8_t *b, const int qtype, const pair8 *x,
                                                               int64_t pairs, const int m, __m256 acc[MAX_ROWS],
                                                               __m128 mins[MAX_ROWS]) {
    const __m256i nibble = _mm256_set1_epi8(0xf);
    if (qtype == Q6_K) {
        const float d = _cvtsh_ss((uint16_t)(b[208] | (b[209] << 8)));
        float scale[16];
        for (int i = 0; i < 16; i++) scale[i] = (float)(int8_t)b[192 + i] * d;
        for (int c = 0; c < 4; c++) {
            const int half = c / 2, high_nibbles = c % 2;
            const __m256i ql_lo = _mm256_loadu_si256((const __m256i *)(b + 64 * half));
            const __m256i ql_hi = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half)), two = _mm256_set1_epi8(0x30);
            /* bits 2 * part .. 2 * part + 1 of qh, moved to bits 4-5: parts 0, 1 (c even) or 2, 3 */
            const __m256i h0 = _mm256_and_si256(high_nibbles ? qh : _mm256_slli_epi16(qh, 4), two);
            const __m256i h1 = _mm256_and_si256(high_nibbles ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 2), two);
            bytes64 w;
            w.lo = _mm256_and_si256(high_nibbles ? _mm256_srli_epi16(ql_lo, 4) : ql_lo, nibble);
            w.hi = _mm256_and_si256(high_nibbles ? _mm256_srli_epi16(ql_hi, 4) : ql_hi, nibble);
            w.lo = _mm256_sub_epi8(_mm256_or_si256(w.lo, h0), _mm256_set1_epi8(32));
            w.hi = _mm256_sub_epi8(_mm256_or_si256(w.hi, h1), _mm256_set1_epi8(32));
            accumulate(w, two_scales(scale[4 * c], scale[4 * c + 1]), two_scales(scale[4 * c + 2], scale[4 * c + 3]),
                       _mm_setzero_ps(), 1, 0, 0, x + c, pairs, m, acc, mins);
        }
        return;
    }
    float scale[8], minimum[8];
    k_scales_of(b, _cvtsh_ss((uint16_t)(b[0] | (b[1] << 8))), _cvtsh_ss((uint16_t)(b[2] | (b[3] << 8))), scale, minimum);
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48);
    for (int c = 0; c < 4; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        bytes64 w;
        w.lo = _mm256_and_si256(raw, nibble);
        w.hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        if (qtype == Q5_K) { /* the fifth bit of sub-block j's value i is bit j of qh[i] */
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            const __m256i bit_lo = _mm256_set1_epi8((char)(1 << (2 * c))), bit_hi = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
            w.lo = with_fifth_bit(w.lo, _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_lo), bit_lo));
            w.hi = with_fifth_bit(w.hi, _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_hi), bit_hi));
        }
        accumulate(w, _mm256_set1_ps(scale[2 * c]), _mm256_set1_ps(scale[2 * c + 1]),
                   _mm_set_ps(-minimum[2 * c + 1], 0.0f, -minimum[2 * c], 0.0f), 0, 1, 0, x + c, pairs, m, acc, mins);
    }
}

/* out[j * out_stride] = x[j] . the row, for j < m (a constant where this is inlined). */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *row, const int qtype, const int bytes,
                                                           int64_t blocks, const pair8 *x, int64_t pairs,
                                                           const int m, float *out, int64_t out_stride) {
    __m256 acc[MAX_ROWS];
    __m128 mins[MAX_ROWS];
    for (int j = 0; j < m; j++) {
        acc[j] = _mm256_setzero_ps();
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
        out[j * out_stride] = sum8(acc[j]) + _mm_cvtss_f32(_mm_add_ss(pairs_of, _mm_shuffle_ps(pairs_of, pairs_of, 1)));
    }
}

#define REST_CASES(QTYPE, BYTES) \
    DOT_ROWS_CASE(QTYPE, BYTES, 1) DOT_ROWS_CASE(QTYPE, BYTES, 2) DOT_ROWS_CASE(QTYPE, BYTES, 3)
X8_KERNELS
#endif
