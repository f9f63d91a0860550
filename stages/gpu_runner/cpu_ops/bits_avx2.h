/* A block's fifth bits (Q5_0, Q5_1, Q5_K's qh) as bytes, for the AVX2 kernels (quant_x8_avx2.c,
 * quant_decode_avx2.c). */
#ifndef PIPELINE_CPU_KERNELS_BITS_AVX2_H
#define PIPELINE_CPU_KERNELS_BITS_AVX2_H

#include <immintrin.h>
#include <stdint.h>

/* 0xff in byte i where bit i of `bits` is set, else 0. */
static inline __m256i bytes_from_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

#endif
