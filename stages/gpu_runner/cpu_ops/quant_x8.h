/* What quant_x8.c (the activations quantized, the entry point) and its products per instruction set
 * (quant_x8_avx512.c, quant_x8_avx2.c) share: the quantized activations' layout and the block types.
 * One of the two product files is built: AVX-512 VNNI where the CPU has it, else AVX2. */
#ifndef PIPELINE_CPU_KERNELS_QUANT_X8_H
#define PIPELINE_CPU_KERNELS_QUANT_X8_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define QUANT_X8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_X8_AVX2 1
#endif
#if defined(QUANT_X8_AVX512) || defined(QUANT_X8_AVX2)
#define QUANT_X8 1
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline int is_k_type(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }
static inline int signed_type(int qtype) { return qtype == Q8_0 || qtype == Q4_0 || qtype == Q5_0; }
static inline int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }

/* The first 4 bytes of a block: its float16 scale, and the minimum of the _1 types. */
static inline uint32_t head(const uint8_t *b) {
    uint32_t word;
    memcpy(&word, b, 4);
    return word;
}

/* Two blocks of one activation row, quantized: their 64 values q (u = q + 128: the unsigned operand
 * for the signed weight types), each block's scale d spread over the lanes its products land in,
 * and s = [0, d0 sum(q0), 0, d1 sum(q1)] (the _1 types' minimum multiplies it). The values are laid
 * out as the weight's bytes are decoded: for the 4- and 5-bit types, whose block holds values i and
 * i + 16 in one byte, block 0's values 0-15, block 1's 0-15, block 0's 16-31, block 1's 16-31 (so
 * lanes 0-3 and 8-11 of a product, a 32-bit lane per 4 bytes, are block 0's); for Q8_0 and the
 * 256-value types, block 0 then block 1. */
typedef struct {
    int8_t q[64];
    uint8_t u[64];
    float d[16];
    float s[4];
} pair8;

/* out[j * out_stride] = x[j] . row (blocks_per_row blocks of qtype), for j < n: x[j] the j-th run of
 * `pairs` pairs from x. Defined by the instruction set's file. */
void x8_row_products(const uint8_t *row, int qtype, int64_t blocks_per_row, const pair8 *x, int64_t pairs,
                     int64_t n, float *out, int64_t out_stride);

/* An instruction set's file defines MAX_ROWS, dot_rows(row, qtype, bytes, blocks, x, pairs, m, out,
 * out_stride) (x[j] . the row for j < m, m a constant where inlined) and REST_CASES(QTYPE, BYTES)
 * (a DOT_ROWS_CASE for each m from 1 to MAX_ROWS - 1), then expands X8_KERNELS: a function per
 * block type, taking n rows in passes of MAX_ROWS and then the rest, and x8_row_products. */
#define DOT_ROWS_CASE(QTYPE, BYTES, M)                                                                         \
    case M: dot_rows(row, QTYPE, BYTES, blocks, x + j0 * pairs, pairs, M, out + j0 * out_stride, out_stride); break;
#define DOT_ROWS_OF(QTYPE, BYTES)                                                                                    \
    static void dot_rows_##QTYPE(const uint8_t *row, int64_t blocks, const pair8 *x, int64_t pairs, int64_t n,    \
                                 float *out, int64_t out_stride) {                                                \
        int64_t j0 = 0;                                                                                           \
        for (; j0 + MAX_ROWS <= n; j0 += MAX_ROWS)                                                                \
            dot_rows(row, QTYPE, BYTES, blocks, x + j0 * pairs, pairs, MAX_ROWS, out + j0 * out_stride, out_stride); \
        switch (n - j0) { REST_CASES(QTYPE, BYTES) }                                                              \
    }
#define X8_KERNELS                                                                                                 \
    DOT_ROWS_OF(Q8_0, 34)                                                                                          \
    DOT_ROWS_OF(Q4_0, 18)                                                                                          \
    DOT_ROWS_OF(Q4_1, 20)                                                                                          \
    DOT_ROWS_OF(Q5_0, 22)                                                                                          \
    DOT_ROWS_OF(Q5_1, 24)                                                                                          \
    DOT_ROWS_OF(Q4_K, 144)                                                                                         \
    DOT_ROWS_OF(Q5_K, 176)                                                                                         \
    DOT_ROWS_OF(Q6_K, 210)                                                                                         \
    void x8_row_products(const uint8_t *row, int qtype, int64_t blocks_per_row, const pair8 *x, int64_t pairs,  \
                         int64_t n, float *out, int64_t out_stride) {                                            \
        switch (qtype) {                                                                                           \
        case Q8_0: dot_rows_Q8_0(row, blocks_per_row, x, pairs, n, out, out_stride); break;                      \
        case Q4_0: dot_rows_Q4_0(row, blocks_per_row, x, pairs, n, out, out_stride); break;                      \
        case Q4_1: dot_rows_Q4_1(row, blocks_per_row, x, pairs, n, out, out_stride); break;                      \
        case Q5_0: dot_rows_Q5_0(row, blocks_per_row, x, pairs, n, out, out_stride); break;                      \
        case Q5_1: dot_rows_Q5_1(row, blocks_per_row, x, pairs, n, out, out_stride); break;                      \
        case Q4_K: dot_rows_Q4_K(row, blocks_per_row, x, pairs, n, out, out_stride); break;                      \
        case Q5_K: dot_rows_Q5_K(row, blocks_per_row, x, pairs, n, out, out_stride); break;                      \
        default: dot_rows_Q6_K(row, blocks_per_row, x, pairs, n, out, out_stride); break;                        \
        }                                                                                                          \
    }

#endif
