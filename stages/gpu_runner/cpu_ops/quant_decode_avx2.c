/* quant.c's row decoding on a CPU with AVX2 but not AVX-512 (where quant.c decodes in 16-value
 * registers itself): 8 values a register instead of the scalar code's one. Every value is the
 * float32 the scalar code gives, bit for bit: the same integers, then the same float operations in
 * the same order, each rounded (-ffp-contract=off). quant.c's quant_decode_row calls it a block at
 * a time, so quant_matmul's decode-then-dot and quant_gemm.c's tiles both decode through it. */
#include <stdint.h>
#include <string.h>

#include "k_scales.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline float half_at(const uint8_t *at) { return _cvtsh_ss((uint16_t)(at[0] | (at[1] << 8))); }

/* 8 bytes at `at`, each shifted right by `shift` and masked, as 8 int32 lanes. */
static inline __m256i bits_of(const uint8_t *at, int shift, int mask) {
    const __m128i bytes = _mm_srl_epi16(_mm_loadl_epi64((const __m128i *)at), _mm_cvtsi32_si128(shift));
    return _mm256_cvtepu8_epi32(_mm_and_si128(bytes, _mm_set1_epi8((char)mask)));
}

/* A 32-value block into w[0..31]. */
static inline void block32(const uint8_t *b, int qtype, float *w) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)));
            _mm256_storeu_ps(w + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
        return;
    }
    const uint8_t *qs = b + (qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8);
    uint32_t qh = 0;
    if (qtype == Q5_0 || qtype == Q5_1) memcpy(&qh, qs - 4, 4);
    const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 m = _mm256_set1_ps(qtype == Q4_1 || qtype == Q5_1 ? half_at(b + 2) : 0.0f);
    for (int i = 0; i < 4; i++) { /* values 8i..8i+7: bytes 0-7 or 8-15, low nibbles (i < 2) or high */
        __m256i q = bits_of(qs + 8 * (i % 2), 4 * (i / 2), 0xf);
        if (qtype == Q5_0 || qtype == Q5_1) { /* value v's fifth bit is bit v of qh */
            const __m256i bit = _mm256_and_si256(_mm256_set1_epi32((int)(qh >> (8 * i))), lane_bits);
            q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi32(bit, lane_bits), _mm256_set1_epi32(16)));
        }
        const __m256 v = _mm256_cvtepi32_ps(q);
        __m256 out;
        if (qtype == Q4_0) out = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(8.0f)), d);
        else if (qtype == Q5_0) out = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(16.0f)), d);
        else out = _mm256_add_ps(_mm256_mul_ps(v, d), m);
        _mm256_storeu_ps(w + 8 * i, out);
    }
}

/* A 256-value block into w[0..255], as quant.c's qk_45 and q6_k. */
static inline void block256(const uint8_t *b, int qtype, float *w) {
    if (qtype == Q6_K) {
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 4; part++)
                for (int g = 0; g < 4; g++) {
                    const __m256i low = bits_of(b + half * 64 + (part % 2) * 32 + 8 * g, (part / 2) * 4, 0xf);
                    const __m256i high = bits_of(b + 128 + half * 32 + 8 * g, part * 2, 3);
                    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)),
                                                       _mm256_set1_epi32(32));
                    const float scale = d * (float)scales[half * 8 + part * 2 + g / 2];
                    _mm256_storeu_ps(w + half * 128 + part * 32 + 8 * g,
                                     _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale)));
                }
        return;
    }
    float scale[8], min[8];
    k_scales_of(b, half_at(b), half_at(b + 2), scale, min);
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48);
    for (int j = 0; j < 8; j++)
        for (int g = 0; g < 4; g++) {
            __m256i q = bits_of(qs + (j / 2) * 32 + 8 * g, (j % 2) * 4, 0xf);
            if (qtype == Q5_K) q = _mm256_or_si256(q, _mm256_slli_epi32(bits_of(b + 16 + 8 * g, j, 1), 4));
            const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale[j]));
            _mm256_storeu_ps(w + j * 32 + 8 * g, _mm256_sub_ps(v, _mm256_set1_ps(min[j])));
        }
}

void quant_decode_block_avx2(const uint8_t *b, int qtype, float *w) {
    if (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K)
        block256(b, qtype, w);
    else
        block32(b, qtype, w);
}
#endif
