/* GGUF block-quantized weights used in place: a weight [rows, cols] is `rows` runs of blocks, each
 * row `row_bytes` long, exactly as the file stores it (ggml's block layouts).
 *
 * quant_dequantize_rows decodes chosen rows to float32 (the embedding's gathered rows, a prefill's
 * tiles); quant_matmul is the decode step's fused dequantize-and-dot: out[j, r] = x[j] . W[r],
 * output rows shared by the decode threads (pool.c). With AVX-512 every block is decoded 16 values a
 * register and multiplied there with up to 8 (32-value types) or 4 (Q4_K, Q5_K, Q6_K) activation
 * rows at a time; with AVX2 (quant_decode_avx2.c) a block's integers are dotted with up to 4 rows
 * and the sum scaled once, d (q . x) (+ m sum(x) for the types with a minimum); else a row is
 * decoded by the scalar code, then dotted. Activations stay float32, and the result is the decoded
 * weights' dot within float32 rounding (8-bit activations with integer dots, llama.cpp's shortcut,
 * are quant_x8.c: --quantized-activations int8).
 *
 * Every decoded value is the float32 that loaders/gguf_quants.py gives, bit for bit: the same
 * operations in the same order, each rounded (-ffp-contract=off; nothing here is an FMA except the
 * dot's own accumulation). Only the dot's order of summation (and on AVX2 its factoring) differs
 * from a float32 matmul.
 * Type ids are ggml's (GGMLQuantizationType).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k_scales.h"
#include "kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__) || defined(__SSE__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static float f16(const uint8_t *at) {
    const uint16_t h = (uint16_t)(at[0] | (at[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, word;
    if (exponent == 0x1f) {
        word = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        word = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        word = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        word = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

static void q8_0(const uint8_t *b, float *w) {
    const float d = f16(b);
    for (int i = 0; i < 32; i++) w[i] = (float)(int8_t)b[2 + i] * d;
}

static void q4_0(const uint8_t *b, float *w) {
    const float d = f16(b);
    for (int i = 0; i < 16; i++) {
        w[i] = ((float)(b[2 + i] & 0xf) - 8.0f) * d;
        w[i + 16] = ((float)(b[2 + i] >> 4) - 8.0f) * d;
    }
}

static void q4_1(const uint8_t *b, float *w) {
    const float d = f16(b), m = f16(b + 2);
    for (int i = 0; i < 16; i++) {
        w[i] = (float)(b[4 + i] & 0xf) * d + m;
        w[i + 16] = (float)(b[4 + i] >> 4) * d + m;
    }
}

/* Q5_0/Q5_1: bit i of the little-endian uint32 at qh is value i's fifth bit. */
static void q5(const uint8_t *b, const uint8_t *qh_at, float *w, int with_min) {
    const float d = f16(b), m = with_min ? f16(b + 2) : 0.0f;
    const uint32_t qh = (uint32_t)qh_at[0] | ((uint32_t)qh_at[1] << 8) | ((uint32_t)qh_at[2] << 16)
                        | ((uint32_t)qh_at[3] << 24);
    const uint8_t *qs = qh_at + 4;
    for (int i = 0; i < 16; i++) {
        const int low = (qs[i] & 0xf) | (int)(((qh >> i) & 1u) << 4);
        const int high = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
        if (with_min) {
            w[i] = (float)low * d + m;
            w[i + 16] = (float)high * d + m;
        } else {
            w[i] = ((float)low - 16.0f) * d;
            w[i + 16] = ((float)high - 16.0f) * d;
        }
    }
}

/* Q4_K/Q5_K: eight 6-bit scales and mins in bytes 4..16, times the block's d and dmin. */
static void k_scales(const uint8_t *b, float *scale, float *min) { k_scales_of(b, f16(b), f16(b + 2), scale, min); }

/* Q4_K (qh NULL) and Q5_K: runs of 32 bytes hold two sub-blocks, low nibbles then high. */
static void qk_45(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *w) {
    float scale[8], min[8];
    k_scales(b, scale, min);
    for (int j = 0; j < 8; j++) {
        const uint8_t *run = qs + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int i = 0; i < 32; i++) {
            int q = (run[i] >> shift) & 0xf;
            if (qh != NULL) q |= ((qh[i] >> j) & 1) << 4;
            w[j * 32 + i] = (float)q * scale[j] - min[j];
        }
    }
}

static void q6_k(const uint8_t *b, float *w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int half = 0; half < 2; half++)
        for (int part = 0; part < 4; part++)
            for (int i = 0; i < 32; i++) {
                const int at = half * 128 + part * 32 + i;
                const int low = (ql[half * 64 + (part % 2) * 32 + i] >> ((part / 2) * 4)) & 0xf;
                const int high = (qh[half * 32 + i] >> (part * 2)) & 3;
                w[at] = (float)((low | (high << 4)) - 32) * (d * (float)scales[at / 16]);
            }
}

#if defined(__AVX512F__)
/* Values 0-15 and 16-31 of a 4-bit block: the low and the high nibbles of its 16 bytes. */
static inline void nibbles(const uint8_t *qs, __m512 *w) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0xf);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}

/* A 32-value block into w[0] (values 0-15) and w[1] (16-31), the same roundings as the scalar code. */
static inline __attribute__((always_inline)) void block32(const uint8_t *b, int qtype, __m512 *w) {
    const __m512 d = _mm512_set1_ps(f16(b));
    switch (qtype) {
    case Q8_0:
        for (int i = 0; i < 2; i++)
            w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                       _mm_loadu_si128((const __m128i *)(b + 2 + 16 * i)))), d);
        return;
    case Q4_0:
        nibbles(b + 2, w);
        for (int i = 0; i < 2; i++) w[i] = _mm512_mul_ps(_mm512_sub_ps(w[i], _mm512_set1_ps(8.0f)), d);
        return;
    case Q4_1:
        nibbles(b + 4, w);
        for (int i = 0; i < 2; i++) w[i] = _mm512_add_ps(_mm512_mul_ps(w[i], d), _mm512_set1_ps(f16(b + 2)));
        return;
    default: { /* Q5_0, Q5_1: the fifth bit adds 16, exactly, to the small integer held as a float */
        const uint8_t *at = b + (qtype == Q5_0 ? 2 : 4);
        uint32_t qh;
        memcpy(&qh, at, 4);
        nibbles(at + 4, w);
        const __m512 sixteen = _mm512_set1_ps(16.0f);
        w[0] = _mm512_mask_add_ps(w[0], (__mmask16)(qh & 0xffffu), w[0], sixteen);
        w[1] = _mm512_mask_add_ps(w[1], (__mmask16)(qh >> 16), w[1], sixteen);
        for (int i = 0; i < 2; i++)
            w[i] = qtype == Q5_0 ? _mm512_mul_ps(_mm512_sub_ps(w[i], sixteen), d)
                                 : _mm512_add_ps(_mm512_mul_ps(w[i], d), _mm512_set1_ps(f16(b + 2)));
    }
    }
}

/* Block k of the row times x[j]'s block k, for j < m, added into acc[j][chain] and acc[j][chain + 1]. */
static inline __attribute__((always_inline)) void block_dot32(const uint8_t *row, const int qtype, const int bytes,
                                                              int64_t cols, const float *x, const int m, int64_t k,
                                                              const int chain, __m512 acc[8][4]) {
    __m512 w[2];
    block32(row + k * bytes, qtype, w);
    for (int j = 0; j < m; j++) {
        const float *xj = x + j * cols + k * 32;
        acc[j][chain] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xj), acc[j][chain]);
        acc[j][chain + 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xj + 16), acc[j][chain + 1]);
    }
}

/* out[j * out_stride] = x[j] . the row, for j < m (m a constant where this is inlined: the
 * accumulators stay in registers, and each call site below is compiled for its block type). One
 * row's sum would be a single chain of dependent FMAs, bound by their latency rather than by
 * reading the blocks: each row sums into 2 chains, 4 where m <= 2 (odd blocks into the other pair). */
static inline __attribute__((always_inline)) void dot_rows32(const uint8_t *row, const int qtype, const int bytes,
                                                             int64_t cols, const float *x, const int m, float *out,
                                                             int64_t out_stride) {
    const int chains = m <= 2 ? 4 : 2;
    __m512 acc[8][4];
    for (int j = 0; j < m; j++)
        for (int c = 0; c < chains; c++) acc[j][c] = _mm512_setzero_ps();
    const int64_t blocks = cols / 32;
    int64_t k = 0;
    for (; k + 1 < blocks; k += 2) {
        block_dot32(row, qtype, bytes, cols, x, m, k, 0, acc);
        block_dot32(row, qtype, bytes, cols, x, m, k + 1, chains - 2, acc);
    }
    if (k < blocks) block_dot32(row, qtype, bytes, cols, x, m, k, 0, acc);
    for (int j = 0; j < m; j++) {
        __m512 sum = _mm512_add_ps(acc[j][0], acc[j][1]);
        if (chains == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[j][2], acc[j][3]));
        out[j * out_stride] = _mm512_reduce_add_ps(sum);
    }
}

#define DOT_ROWS32_OF(QTYPE, BYTES)                                                                 \
    static void dot_rows32_##QTYPE(const uint8_t *row, int64_t cols, const float *x, int64_t n, float *out, \
                                   int64_t out_stride) {                                            \
        int64_t j0 = 0;                                                                             \
        for (; j0 + 8 <= n; j0 += 8) dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 8, out + j0 * out_stride, out_stride); \
        switch (n - j0) {                                                                           \
        case 1: dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 1, out + j0 * out_stride, out_stride); break; \
        case 2: dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 2, out + j0 * out_stride, out_stride); break; \
        case 3: dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 3, out + j0 * out_stride, out_stride); break; \
        case 4: dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 4, out + j0 * out_stride, out_stride); break; \
        case 5: dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 5, out + j0 * out_stride, out_stride); break; \
        case 6: dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 6, out + j0 * out_stride, out_stride); break; \
        case 7: dot_rows32(row, QTYPE, BYTES, cols, x + j0 * cols, 7, out + j0 * out_stride, out_stride); break; \
        }                                                                                           \
    }
DOT_ROWS32_OF(Q8_0, 34)
DOT_ROWS32_OF(Q4_0, 18)
DOT_ROWS32_OF(Q4_1, 20)
DOT_ROWS32_OF(Q5_0, 22)
DOT_ROWS32_OF(Q5_1, 24)

/* out[j * out_stride] = x[j] . the row, for j < n: each block decoded once, into registers. */
static void dot_row32(const uint8_t *row, int qtype, int64_t cols, const float *x, int64_t n, float *out,
                      int64_t out_stride) {
    switch (qtype) {
    case Q8_0: dot_rows32_Q8_0(row, cols, x, n, out, out_stride); return;
    case Q4_0: dot_rows32_Q4_0(row, cols, x, n, out, out_stride); return;
    case Q4_1: dot_rows32_Q4_1(row, cols, x, n, out, out_stride); return;
    case Q5_0: dot_rows32_Q5_0(row, cols, x, n, out, out_stride); return;
    default: dot_rows32_Q5_1(row, cols, x, n, out, out_stride); return;
    }
}
/* The 256-value types into w (Q4_K, Q5_K, Q6_K), 16 values a vector, the scalar code's roundings. */
static inline __m512 widen(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

static inline __m128i shifted(const uint8_t *at, int shift, int mask) {
    return _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)at), shift), _mm_set1_epi8((char)mask));
}

/* 16 decoded values of a 256-value block, at `at` in the row: stored into w (x NULL), or dotted
 * with x[j] for j < m into acc[j][chain] (the decoded values never leave the registers). */
static inline __attribute__((always_inline)) void emit16(__m512 v, float *w, int64_t at, const float *x,
                                                         int64_t cols, const int m, const int chain, __m512 acc[][2]) {
    if (x == NULL) _mm512_storeu_ps(w + at, v);
    else
        for (int j = 0; j < m; j++) acc[j][chain] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + j * cols + at), acc[j][chain]);
}

/* Block k of a row of 256-value blocks: decoded into w + k * 256 (x NULL), or dotted with x[j]'s
 * values k * 256.. for j < m (see emit16). */
static inline __attribute__((always_inline)) void block256_emit(const uint8_t *b, const int qtype, float *w,
                                                                int64_t k, const float *x, int64_t cols, const int m,
                                                                __m512 acc[][2]) {
    if (qtype == Q6_K) {
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 4; part++)
                for (int g = 0; g < 2; g++) {
                    const __m128i low = shifted(b + half * 64 + (part % 2) * 32 + g * 16, (part / 2) * 4, 0xf);
                    const __m128i high = _mm_slli_epi16(shifted(b + 128 + half * 32 + g * 16, part * 2, 3), 4);
                    const __m512 q = _mm512_sub_ps(widen(_mm_or_si128(low, high)), _mm512_set1_ps(32.0f));
                    const float scale = d * (float)scales[half * 8 + part * 2 + g];
                    emit16(_mm512_mul_ps(q, _mm512_set1_ps(scale)), w, k * 256 + half * 128 + part * 32 + g * 16, x, cols, m, g,
                           acc);
                }
        return;
    }
    float scale[8], min[8];
    k_scales(b, scale, min);
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48);
    for (int j = 0; j < 8; j++)
        for (int g = 0; g < 2; g++) {
            __m128i q = shifted(qs + (j / 2) * 32 + g * 16, (j % 2) * 4, 0xf);
            if (qtype == Q5_K) q = _mm_or_si128(q, _mm_slli_epi16(shifted(b + 16 + g * 16, j, 1), 4));
            const __m512 v = _mm512_mul_ps(widen(q), _mm512_set1_ps(scale[j]));
            emit16(_mm512_sub_ps(v, _mm512_set1_ps(min[j])), w, k * 256 + j * 32 + g * 16, x, cols, m, g, acc);
        }
}
static void block256(const uint8_t *b, int qtype, float *w) { block256_emit(b, qtype, w, 0, NULL, 0, 0, NULL); }

/* out[j * out_stride] = x[j] . the row of 256-value blocks, for j < m (a constant where inlined). */
static inline __attribute__((always_inline)) void dot_rows256(const uint8_t *row, const int qtype, const int bytes,
                                                              int64_t cols, const float *x, const int m, float *out,
                                                              int64_t out_stride) {
    __m512 acc[4][2];
    for (int j = 0; j < m; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < cols / 256; k++) block256_emit(row + k * bytes, qtype, NULL, k, x, cols, m, acc);
    for (int j = 0; j < m; j++) out[j * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]));
}

#define DOT_ROWS256_OF(QTYPE, BYTES)                                                                  \
    static void dot_rows256_##QTYPE(const uint8_t *row, int64_t cols, const float *x, int64_t n, float *out, \
                                    int64_t out_stride) {                                             \
        int64_t j0 = 0;                                                                               \
        for (; j0 + 4 <= n; j0 += 4) dot_rows256(row, QTYPE, BYTES, cols, x + j0 * cols, 4, out + j0 * out_stride, out_stride); \
        switch (n - j0) {                                                                             \
        case 1: dot_rows256(row, QTYPE, BYTES, cols, x + j0 * cols, 1, out + j0 * out_stride, out_stride); break; \
        case 2: dot_rows256(row, QTYPE, BYTES, cols, x + j0 * cols, 2, out + j0 * out_stride, out_stride); break; \
        case 3: dot_rows256(row, QTYPE, BYTES, cols, x + j0 * cols, 3, out + j0 * out_stride, out_stride); break; \
        }                                                                                             \
    }
DOT_ROWS256_OF(Q4_K, 144)
DOT_ROWS256_OF(Q5_K, 176)
DOT_ROWS256_OF(Q6_K, 210)

/* out[j * out_stride] = x[j] . the row of 256-value blocks, for j < n, each block decoded in registers. */
static void dot_row256(const uint8_t *row, int qtype, int64_t cols, const float *x, int64_t n, float *out,
                       int64_t out_stride) {
    switch (qtype) {
    case Q4_K: dot_rows256_Q4_K(row, cols, x, n, out, out_stride); return;
    case Q5_K: dot_rows256_Q5_K(row, cols, x, n, out, out_stride); return;
    default: dot_rows256_Q6_K(row, cols, x, n, out, out_stride); return;
    }
}
#endif

static int block_values(int qtype) {
    return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 256 : 32;
}

static int block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

int quant_block_bytes(int qtype) { return block_bytes(qtype); } /* 0: a type not decoded here */

/* One row of `cols` values decoded into w (quant_gemm.c's tiles use it too). */
void quant_decode_row(const uint8_t *row, int qtype, int64_t cols, float *w) {
    const int values = block_values(qtype), bytes = block_bytes(qtype);
    if (bytes == 0) return; /* a type not decoded here: the operators refuse it first */
#if defined(__AVX512F__)
    if (values == 32) {
        for (int64_t k = 0; k < cols / 32; k++) {
            __m512 v[2];
            block32(row + k * bytes, qtype, v);
            _mm512_storeu_ps(w + k * 32, v[0]);
            _mm512_storeu_ps(w + k * 32 + 16, v[1]);
        }
        return;
    }
    for (int64_t k = 0; k < cols / 256; k++) block256(row + k * bytes, qtype, w + k * 256);
    return;
#elif defined(QUANT_AVX2)
    for (int64_t k = 0; k < cols / values; k++) quant_decode_block_avx2(row + k * bytes, qtype, w + k * values);
    return;
#endif
    for (int64_t k = 0; k < cols / values; k++) {
        const uint8_t *b = row + k * bytes;
        float *out = w + k * values;
        switch (qtype) {
        case Q4_0: q4_0(b, out); break;
        case Q4_1: q4_1(b, out); break;
        case Q5_0: q5(b, b + 2, out, 0); break;
        case Q5_1: q5(b, b + 4, out, 1); break;
        case Q8_0: q8_0(b, out); break;
        case Q4_K: qk_45(b, NULL, b + 16, out); break;
        case Q5_K: qk_45(b, b + 16, b + 48, out); break;
        case Q6_K: q6_k(b, out); break;
        }
    }
}

/* The scalar path's dot (AVX-512 and AVX2 multiply decoded registers in place, never a stored row). */
static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* out [n, cols] = rows ids[i] (or first + i where ids is NULL) of the weight, decoded. */
void quant_dequantize_rows(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t cols, const int64_t *ids,
                           int64_t first, int64_t n, float *out) {
#pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t i = 0; i < n; i++)
        quant_decode_row(blocks + (ids != NULL ? ids[i] : first + i) * row_bytes, qtype, cols, out + i * cols);
}

/* How far ahead of the row being multiplied its thread asks for the blocks (bytes): the hardware
 * prefetcher alone leaves a decode step well short of the memory's bandwidth (measured on a 262,144-row
 * Q8_0 head, one thread: 30 ms without, 22 ms with 4 KiB ahead, against 17 ms to merely read it). */
#define PREFETCH_AHEAD 4096

static inline void prefetch_row(const uint8_t *row, int64_t row_bytes) {
#if defined(__SSE__) || defined(__AVX2__) || defined(__AVX512F__)
    for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + at, _MM_HINT_T0);
#else
    (void)row;
    (void)row_bytes;
#endif
}

typedef struct {
    const uint8_t *blocks;
    int qtype;
    int64_t row_bytes, rows, cols, n;
    const float *x, *sums;
    float *out;
} matmul_job;

/* Rows [begin, end) of a product: one thread's chunk. */
static void matmul_rows(void *job_pointer, int64_t begin, int64_t end) {
    const matmul_job *j = job_pointer;
    float *w = NULL; /* the scalar path's decoded row */
    for (int64_t r = begin; r < end; r++) {
        const uint8_t *row = j->blocks + r * j->row_bytes;
        prefetch_row(row, j->row_bytes);
#if defined(__AVX512F__)
        if (block_values(j->qtype) == 32)
            dot_row32(row, j->qtype, j->cols, j->x, j->n, j->out + r, j->rows);
        else
            dot_row256(row, j->qtype, j->cols, j->x, j->n, j->out + r, j->rows);
        continue;
#elif defined(QUANT_AVX2)
        quant_dot_row_avx2(row, j->qtype, j->cols, j->x, j->sums, j->n, j->out + r, j->rows);
        continue;
#endif
        if (w == NULL && (w = malloc(sizeof(float) * j->cols)) == NULL) abort(); /* cols floats: a few KiB */
        quant_decode_row(row, j->qtype, j->cols, w);
        for (int64_t k = 0; k < j->n; k++) j->out[k * j->rows + r] = dot(w, j->x + k * j->cols, j->cols);
    }
    free(w);
}

/* out [n, rows] = x [n, cols] times the weight [rows, cols] transposed. */
void quant_matmul(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t rows, int64_t cols, const float *x,
                  int64_t n, float *out) {
    matmul_job job = {blocks, qtype, row_bytes, rows, cols, n, x, NULL, out};
#if defined(QUANT_AVX2)
    /* x's block sums, which the minimums of Q4_1, Q5_1, Q4_K and Q5_K multiply (the other types read none) */
    float *sums = NULL;
    if (qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K) {
        sums = malloc(sizeof(float) * (size_t)(n * (cols / 32)));
        if (sums == NULL) abort();
        quant_block_sums_avx2(x, n, cols, sums);
    }
    job.sums = sums;
#endif
    pool_enter();
    pool_run(matmul_rows, &job, rows, pool_grain(rows, 64));
    pool_leave();
#if defined(QUANT_AVX2)
    free(sums);
#endif
}
