/* quant.c's blocks on a CPU with AVX2 but not AVX-512 (where quant.c decodes in 16-value registers
 * itself): 8 values a register instead of the scalar code's one. Every value is the float32 the
 * scalar code gives, bit for bit: the same integers, then the same float operations in the same
 * order, each rounded (-ffp-contract=off): quant_decode_block_avx2, a block stored as floats
 * (quant_decode_row, so quant_gemm.c's tiles).
 *
 * quant_dot_row_avx2 is the decode step's fused dequantize-and-dot (quant_matmul), with up to 4
 * activation rows a pass. It does not decode each value: a block's (or sub-block's) integers, as
 * floats, are dotted with x and the sum is scaled once, d (q . x), and the minimum of the _1 and K
 * types enters as m sum(x) (x's block sums, taken once a product). Per 8 values that is a widening,
 * a conversion and one multiply-add, against the decoder's two more float operations: on one
 * stream the default float32 product is bound by those operations, not by reading the blocks. The
 * result is the dequantized weights' dot with x within float32 rounding, in another order; a row of
 * the identity still gives each decoded weight exactly (d q rounded once, then m added, as the
 * decoder does). */
#include <stdint.h>
#include <string.h>

#include "k_scales.h"
#include "kernels.h"

#if defined(QUANT_AVX2)
#include <immintrin.h>

#include "avx2.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define MAX_ROWS 4 /* activation rows a pass: an accumulator and a block sum each, and the block's registers, fit 16 */
#define INLINE static inline __attribute__((always_inline))

static inline float half_at(const uint8_t *at) { return _cvtsh_ss((uint16_t)(at[0] | (at[1] << 8))); }

/* The 32 bytes at `at`, each shifted right by `shift` and masked. */
static inline __m256i bytes_of(const uint8_t *at, int shift, int mask) {
    const __m256i bytes = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)at), _mm_cvtsi32_si128(shift));
    return _mm256_and_si256(bytes, _mm256_set1_epi8((char)mask));
}

/* Bytes 8g..8g+7 of `bytes` (g < 4), in the low 8 bytes. */
static inline __m128i eight_of(__m256i bytes, int g) {
    const __m128i half = g < 2 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
    return g % 2 ? _mm_srli_si128(half, 8) : half;
}

/* The 32 integers of block b (a 4- or 5-bit type) as bytes, value v in byte v: unsigned for Q4_1 and
 * Q5_1; signed for Q4_0 and Q5_0, their zero point taken off (exact, so d q is the decoded value). */
INLINE __m256i block32_integers(const uint8_t *b, const int qtype) {
    const uint8_t *qs = b + (qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8);
    /* values 0-15 the low nibbles of the 16 bytes, 16-31 the high ones */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xf));
    if (qtype == Q5_0 || qtype == Q5_1) { /* value v's fifth bit is bit v of qh: 16 in byte v */
        uint32_t qh;
        memcpy(&qh, qs - 4, 4);
        q = _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(16)));
    }
    if (qtype == Q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    if (qtype == Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    return q;
}

/* Q6_K's 32 integers of `part` (< 4) of `half` (< 2): 4 bits of ql, 2 of qh, less 32 (fits a byte). */
INLINE __m256i q6k_integers(const uint8_t *b, int half, int part) {
    const __m256i low = bytes_of(b + half * 64 + (part % 2) * 32, (part / 2) * 4, 0xf);
    const __m256i high = bytes_of(b + 128 + half * 32, part * 2, 3);
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}

/* Q4_K or Q5_K's 32 (unsigned) integers of sub-block `sub` (< 8): the low (sub even) or high nibbles
 * of a run of 32 bytes, and for Q5_K bit `sub` of qh[i] as 16. */
INLINE __m256i k_integers(const uint8_t *b, const int qtype, int sub) {
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48);
    const __m256i q = bytes_of(qs + (sub / 2) * 32, (sub % 2) * 4, 0xf);
    return qtype == Q5_K ? _mm256_or_si256(q, _mm256_slli_epi16(bytes_of(b + 16, sub, 1), 4)) : q;
}

/* Bytes 8g..8g+7 of q as 8 floats, signed or unsigned. */
INLINE __m256 eight_floats(__m256i q, int g, const int is_signed) {
    const __m128i eight = eight_of(q, g);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
}

/* Q8_0's bytes 8g..8g+7 of block b, as they lie, widened straight from memory. */
INLINE __m256 q8_eight_floats(const uint8_t *b, int g) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * g))));
}

/* Block b of 32 values (a 32-value type), decoded into w [32]. */
INLINE void block32_decode(const uint8_t *b, const int qtype, float *w) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    if (qtype == Q8_0) {
        for (int g = 0; g < 4; g++) _mm256_storeu_ps(w + 8 * g, _mm256_mul_ps(q8_eight_floats(b, g), d));
        return;
    }
    const int with_min = qtype == Q4_1 || qtype == Q5_1;
    const __m256 min = _mm256_set1_ps(with_min ? half_at(b + 2) : 0.0f);
    const __m256i q = block32_integers(b, qtype);
    for (int g = 0; g < 4; g++) { /* values 8g..8g+7 */
        const __m256 v = _mm256_mul_ps(eight_floats(q, g, !with_min), d);
        _mm256_storeu_ps(w + 8 * g, with_min ? _mm256_add_ps(v, min) : v);
    }
}

/* Block b of 256 values (Q4_K, Q5_K, Q6_K, as quant.c's qk_45 and q6_k), decoded into w [256]. */
INLINE void block256_decode(const uint8_t *b, const int qtype, float *w) {
    if (qtype == Q6_K) {
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 4; part++) {
                const __m256i q = q6k_integers(b, half, part);
                for (int g = 0; g < 4; g++) {
                    const float scale = d * (float)scales[half * 8 + part * 2 + g / 2];
                    _mm256_storeu_ps(w + half * 128 + part * 32 + 8 * g, _mm256_mul_ps(eight_floats(q, g, 1), _mm256_set1_ps(scale)));
                }
            }
        return;
    }
    float scale[8], min[8];
    k_scales_of(b, half_at(b), half_at(b + 2), scale, min);
    for (int j = 0; j < 8; j++) {
        const __m256i q = k_integers(b, qtype, j);
        for (int g = 0; g < 4; g++) {
            const __m256 v = _mm256_mul_ps(eight_floats(q, g, 0), _mm256_set1_ps(scale[j]));
            _mm256_storeu_ps(w + j * 32 + 8 * g, _mm256_sub_ps(v, _mm256_set1_ps(min[j])));
        }
    }
}

void quant_decode_block_avx2(const uint8_t *b, int qtype, float *w) {
    if (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K)
        block256_decode(b, qtype, w);
    else
        block32_decode(b, qtype, w);
}

/* 8 floats v (group g of a run starting at `at`) times x[j] there, for j < m: s[j] begun at g 0. */
INLINE void dot_eight(__m256 v, int g, const float *x, int64_t cols, int64_t at, const int m, __m256 s[MAX_ROWS]) {
    for (int j = 0; j < m; j++) {
        const __m256 xv = _mm256_loadu_ps(x + j * cols + at + 8 * g);
        s[j] = g == 0 ? _mm256_mul_ps(v, xv) : _mm256_fmadd_ps(v, xv, s[j]);
    }
}

/* 8 * groups values of q (from byte 8 * first), as floats, dotted with x[j] at `at` (j < m): s[j]. */
INLINE void dot_groups(__m256i q, int first, int groups, const int is_signed, const float *x, int64_t cols,
                       int64_t at, const int m, __m256 s[MAX_ROWS]) {
    for (int g = 0; g < groups; g++) dot_eight(eight_floats(q, first + g, is_signed), g, x, cols, at, m, s);
}

/* Block k of a row of 32-value blocks times x[j] (j < m): d (q . x[j]) into acc[j], and for the _1
 * types m sum(x[j]'s block k) into mins[j] (sums: x's block sums, `blocks` a row). */
INLINE void block32_dot(const uint8_t *b, const int qtype, int64_t k, const float *x, int64_t cols, const float *sums,
                        int64_t blocks, const int m, __m256 acc[MAX_ROWS], float mins[MAX_ROWS]) {
    __m256 s[MAX_ROWS];
    if (qtype == Q8_0)
        for (int g = 0; g < 4; g++) dot_eight(q8_eight_floats(b, g), g, x, cols, k * 32, m, s);
    else
        dot_groups(block32_integers(b, qtype), 0, 4, qtype != Q4_1 && qtype != Q5_1, x, cols, k * 32, m, s);
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int j = 0; j < m; j++) acc[j] = _mm256_fmadd_ps(s[j], d, acc[j]);
    if (qtype == Q4_1 || qtype == Q5_1) {
        const float min = half_at(b + 2);
        for (int j = 0; j < m; j++) mins[j] += min * sums[j * blocks + k];
    }
}

/* Block k of a row of 256-value blocks times x[j] (j < m), sub-block by sub-block as block32_dot:
 * Q4_K and Q5_K's 8 sub-blocks of 32 (a scale and a minimum each), Q6_K's 16 of 16 (a scale each). */
INLINE void block256_dot(const uint8_t *b, const int qtype, int64_t k, const float *x, int64_t cols, const float *sums,
                         int64_t blocks, const int m, __m256 acc[MAX_ROWS], float mins[MAX_ROWS]) {
    __m256 s[MAX_ROWS];
    if (qtype == Q6_K) {
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 4; part++) {
                const __m256i q = q6k_integers(b, half, part);
                for (int sub = 0; sub < 2; sub++) {
                    dot_groups(q, 2 * sub, 2, 1, x, cols, k * 256 + half * 128 + part * 32 + 16 * sub, m, s);
                    const __m256 scale = _mm256_set1_ps(d * (float)scales[half * 8 + part * 2 + sub]);
                    for (int j = 0; j < m; j++) acc[j] = _mm256_fmadd_ps(s[j], scale, acc[j]);
                }
            }
        return;
    }
    float scale[8], min[8];
    k_scales_of(b, half_at(b), half_at(b + 2), scale, min);
    for (int sub = 0; sub < 8; sub++) {
        dot_groups(k_integers(b, qtype, sub), 0, 4, 0, x, cols, k * 256 + sub * 32, m, s);
        const __m256 sub_scale = _mm256_set1_ps(scale[sub]);
        for (int j = 0; j < m; j++) {
            acc[j] = _mm256_fmadd_ps(s[j], sub_scale, acc[j]);
            mins[j] -= min[sub] * sums[j * blocks + k * 8 + sub];
        }
    }
}

/* out[j * out_stride] = x[j] . the row, for j < m (a constant where inlined: the accumulators stay
 * in registers, and each call site below is compiled for its block type). */
INLINE void dot_rows(const uint8_t *row, const int qtype, const int bytes, int64_t cols, const float *x,
                     const float *sums, const int m, float *out, int64_t out_stride) {
    __m256 acc[MAX_ROWS];
    float mins[MAX_ROWS];
    for (int j = 0; j < m; j++) acc[j] = _mm256_setzero_ps(), mins[j] = 0.0f;
    if (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K)
        for (int64_t k = 0; k < cols / 256; k++) block256_dot(row + k * bytes, qtype, k, x, cols, sums, cols / 32, m, acc, mins);
    else
        for (int64_t k = 0; k < cols / 32; k++) block32_dot(row + k * bytes, qtype, k, x, cols, sums, cols / 32, m, acc, mins);
    for (int j = 0; j < m; j++) out[j * out_stride] = sum8(acc[j]) + mins[j];
}

/* Row j0's block sums on (none where the type reads none). */
static inline const float *sums_from(const float *sums, int64_t j0, int64_t cols) {
    return sums == NULL ? NULL : sums + j0 * (cols / 32);
}

#define DOT_ROWS_CASE(QTYPE, BYTES, M)                                                                            \
    case M:                                                                                                       \
        dot_rows(row, QTYPE, BYTES, cols, x + j0 * cols, sums_from(sums, j0, cols), M, out + j0 * out_stride, out_stride); \
        break;
#define DOT_ROWS_OF(QTYPE, BYTES)                                                                               \
    static void dot_rows_##QTYPE(const uint8_t *row, int64_t cols, const float *x, const float *sums, int64_t n, \
                                 float *out, int64_t out_stride) {                                             \
        int64_t j0 = 0;                                                                                        \
        for (; j0 + MAX_ROWS <= n; j0 += MAX_ROWS)                                                             \
            dot_rows(row, QTYPE, BYTES, cols, x + j0 * cols, sums_from(sums, j0, cols), MAX_ROWS, out + j0 * out_stride, \
                     out_stride);                                                                              \
        switch (n - j0) { DOT_ROWS_CASE(QTYPE, BYTES, 1) DOT_ROWS_CASE(QTYPE, BYTES, 2) DOT_ROWS_CASE(QTYPE, BYTES, 3) } \
    }
DOT_ROWS_OF(Q8_0, 34)
DOT_ROWS_OF(Q4_0, 18)
DOT_ROWS_OF(Q4_1, 20)
DOT_ROWS_OF(Q5_0, 22)
DOT_ROWS_OF(Q5_1, 24)
DOT_ROWS_OF(Q4_K, 144)
DOT_ROWS_OF(Q5_K, 176)
DOT_ROWS_OF(Q6_K, 210)

/* sums [n, cols / 32]: each block of 32 of each x[j], summed (for the minimums). */
void quant_block_sums_avx2(const float *x, int64_t n, int64_t cols, float *sums) {
    for (int64_t i = 0; i < n * (cols / 32); i++) {
        const float *at = x + i * 32;
        const __m256 a = _mm256_add_ps(_mm256_loadu_ps(at), _mm256_loadu_ps(at + 8));
        const __m256 b = _mm256_add_ps(_mm256_loadu_ps(at + 16), _mm256_loadu_ps(at + 24));
        sums[i] = sum8(_mm256_add_ps(a, b));
    }
}

void quant_dot_row_avx2(const uint8_t *row, int qtype, int64_t cols, const float *x, const float *sums, int64_t n,
                        float *out, int64_t out_stride) {
    switch (qtype) {
    case Q8_0: dot_rows_Q8_0(row, cols, x, sums, n, out, out_stride); return;
    case Q4_0: dot_rows_Q4_0(row, cols, x, sums, n, out, out_stride); return;
    case Q4_1: dot_rows_Q4_1(row, cols, x, sums, n, out, out_stride); return;
    case Q5_0: dot_rows_Q5_0(row, cols, x, sums, n, out, out_stride); return;
    case Q5_1: dot_rows_Q5_1(row, cols, x, sums, n, out, out_stride); return;
    case Q4_K: dot_rows_Q4_K(row, cols, x, sums, n, out, out_stride); return;
    case Q5_K: dot_rows_Q5_K(row, cols, x, sums, n, out, out_stride); return;
    default: dot_rows_Q6_K(row, cols, x, sums, n, out, out_stride); return;
    }
}
#endif
