/* quant.c's blocks on a CPU with AVX2 but not AVX-512 (where quant.c decodes in 16-value registers
 * itself): 8 values a register instead of the scalar code's one. Every value is the float32 the
 * scalar code gives, bit for bit: the same integers, then the same float operations in the same
 * order, each rounded (-ffp-contract=off). Two uses, one decoder (block32_emit, block256_emit):
 *   - quant_decode_block_avx2: a block stored as floats (quant_decode_row, so quant_gemm.c's tiles);
 *   - quant_dot_row_avx2: the decode step's fused dequantize-and-dot (quant_matmul), each decoded
 *     register multiplied there with up to 4 activation rows, never stored. */
#include <stdint.h>
#include <string.h>

#include "k_scales.h"
#include "kernels.h"

#if defined(QUANT_AVX2)
#include <immintrin.h>

#include "avx2.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define MAX_ROWS 4 /* activation rows a pass: 2 accumulators each, and the decoding's registers, fit 16 */
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

/* 8 decoded values, at `at` in the row: stored into w (x NULL), or multiplied with x[j]'s values
 * there for j < m and added into acc[j][chain]. */
INLINE void emit8(__m256 v, float *w, int64_t at, const float *x, int64_t cols, const int m, const int chain,
                  __m256 acc[][2]) {
    if (x == NULL) _mm256_storeu_ps(w + at, v);
    else
        for (int j = 0; j < m; j++) acc[j][chain] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + j * cols + at), acc[j][chain]);
}

/* Block k of a row of 32-value blocks (at b), emitted as values k * 32.. (see emit8). */
INLINE void block32_emit(const uint8_t *b, const int qtype, float *w, int64_t k, const float *x, int64_t cols,
                         const int m, __m256 acc[][2]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)));
            emit8(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), w, k * 32 + 8 * i, x, cols, m, i % 2, acc);
        }
        return;
    }
    const uint8_t *qs = b + (qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8);
    const __m256 min = _mm256_set1_ps(qtype == Q4_1 || qtype == Q5_1 ? half_at(b + 2) : 0.0f);
    /* value v in byte v: values 0-15 the low nibbles of the 16 bytes, 16-31 the high ones */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xf));
    if (qtype == Q5_0 || qtype == Q5_1) { /* value v's fifth bit is bit v of qh: 16 in byte v */
        uint32_t qh;
        memcpy(&qh, qs - 4, 4);
        q = _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(16)));
    }
    for (int i = 0; i < 4; i++) { /* values 8i..8i+7 */
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_of(q, i)));
        __m256 out;
        if (qtype == Q4_0) out = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(8.0f)), d);
        else if (qtype == Q5_0) out = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(16.0f)), d);
        else out = _mm256_add_ps(_mm256_mul_ps(v, d), min);
        emit8(out, w, k * 32 + 8 * i, x, cols, m, i % 2, acc);
    }
}

/* Block k of a row of 256-value blocks (Q4_K, Q5_K, Q6_K, as quant.c's qk_45 and q6_k), emitted as
 * values k * 256.. (see emit8). */
INLINE void block256_emit(const uint8_t *b, const int qtype, float *w, int64_t k, const float *x, int64_t cols,
                          const int m, __m256 acc[][2]) {
    if (qtype == Q6_K) {
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 4; part++) { /* 32 values: 4 bits of ql, 2 of qh, less 32 (fits a byte) */
                const __m256i low = bytes_of(b + half * 64 + (part % 2) * 32, (part / 2) * 4, 0xf);
                const __m256i high = bytes_of(b + 128 + half * 32, part * 2, 3);
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
                for (int g = 0; g < 4; g++) {
                    const float scale = d * (float)scales[half * 8 + part * 2 + g / 2];
                    emit8(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight_of(q, g))), _mm256_set1_ps(scale)),
                          w, k * 256 + half * 128 + part * 32 + 8 * g, x, cols, m, g % 2, acc);
                }
            }
        return;
    }
    float scale[8], min[8];
    k_scales_of(b, half_at(b), half_at(b + 2), scale, min);
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48);
    for (int j = 0; j < 8; j++) { /* sub-block j: the low (j even) or high nibbles of a run of 32 bytes */
        __m256i q = bytes_of(qs + (j / 2) * 32, (j % 2) * 4, 0xf);
        if (qtype == Q5_K) q = _mm256_or_si256(q, _mm256_slli_epi16(bytes_of(b + 16, j, 1), 4)); /* bit j of qh[i] */
        for (int g = 0; g < 4; g++) {
            const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_of(q, g))), _mm256_set1_ps(scale[j]));
            emit8(_mm256_sub_ps(v, _mm256_set1_ps(min[j])), w, k * 256 + j * 32 + 8 * g, x, cols, m, g % 2, acc);
        }
    }
}

void quant_decode_block_avx2(const uint8_t *b, int qtype, float *w) {
    if (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K)
        block256_emit(b, qtype, w, 0, NULL, 0, 0, NULL);
    else
        block32_emit(b, qtype, w, 0, NULL, 0, 0, NULL);
}

/* out[j * out_stride] = x[j] . the row, for j < m (a constant where inlined: the accumulators stay
 * in registers, and each call site below is compiled for its block type). */
INLINE void dot_rows(const uint8_t *row, const int qtype, const int bytes, int64_t cols, const float *x, const int m,
                     float *out, int64_t out_stride) {
    __m256 acc[MAX_ROWS][2];
    for (int j = 0; j < m; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    if (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K)
        for (int64_t k = 0; k < cols / 256; k++) block256_emit(row + k * bytes, qtype, NULL, k, x, cols, m, acc);
    else
        for (int64_t k = 0; k < cols / 32; k++) block32_emit(row + k * bytes, qtype, NULL, k, x, cols, m, acc);
    for (int j = 0; j < m; j++) out[j * out_stride] = sum8(_mm256_add_ps(acc[j][0], acc[j][1]));
}

#define DOT_ROWS_CASE(QTYPE, BYTES, M) \
    case M: dot_rows(row, QTYPE, BYTES, cols, x + j0 * cols, M, out + j0 * out_stride, out_stride); break;
#define DOT_ROWS_OF(QTYPE, BYTES)                                                                               \
    static void dot_rows_##QTYPE(const uint8_t *row, int64_t cols, const float *x, int64_t n, float *out,      \
                                 int64_t out_stride) {                                                         \
        int64_t j0 = 0;                                                                                        \
        for (; j0 + MAX_ROWS <= n; j0 += MAX_ROWS)                                                             \
            dot_rows(row, QTYPE, BYTES, cols, x + j0 * cols, MAX_ROWS, out + j0 * out_stride, out_stride);     \
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

void quant_dot_row_avx2(const uint8_t *row, int qtype, int64_t cols, const float *x, int64_t n, float *out,
                        int64_t out_stride) {
    switch (qtype) {
    case Q8_0: dot_rows_Q8_0(row, cols, x, n, out, out_stride); return;
    case Q4_0: dot_rows_Q4_0(row, cols, x, n, out, out_stride); return;
    case Q4_1: dot_rows_Q4_1(row, cols, x, n, out, out_stride); return;
    case Q5_0: dot_rows_Q5_0(row, cols, x, n, out, out_stride); return;
    case Q5_1: dot_rows_Q5_1(row, cols, x, n, out, out_stride); return;
    case Q4_K: dot_rows_Q4_K(row, cols, x, n, out, out_stride); return;
    case Q5_K: dot_rows_Q5_K(row, cols, x, n, out, out_stride); return;
    default: dot_rows_Q6_K(row, cols, x, n, out, out_stride); return;
    }
}
#endif
