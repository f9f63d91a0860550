/* What the AVX2 kernels share (attention.c, quant_x8_avx2.c, quant_decode_avx2.c). */
#ifndef PIPELINE_CPU_KERNELS_AVX2_H
#define PIPELINE_CPU_KERNELS_AVX2_H

#include <immintrin.h>
#include <stdint.h>

/* 0xff in byte i where bit i of `bits` is set, else 0: a block's fifth bits (Q5_0, Q5_1's qh) as bytes. */
static inline __m256i bytes_from_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

/* The sum of v's 8 lanes: lane l + 4, then l + 2, then l + 1 (_mm512_reduce_add_ps's order from there). */
static inline float sum8(__m256 v) {
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    four = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}

#endif
