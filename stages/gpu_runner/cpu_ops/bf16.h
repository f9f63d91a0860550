/* bfloat16 <-> float32, as torch converts: widening is exact, narrowing rounds to nearest even. */
#ifndef PIPELINE_CPU_KERNELS_BF16_H
#define PIPELINE_CPU_KERNELS_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t word = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t word;
    memcpy(&word, &value, sizeof word);
    const uint32_t rounded = (word + 0x7fffu + ((word >> 16) & 1u)) >> 16;
    const uint32_t quiet = (word >> 16) | 0x40u; /* NaN stays NaN */
    return (uint16_t)((word & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* What torch stores for a float32 result in a tensor of the kernel's dtype, read back as float32. */
static inline float round_to(float value, int bf16) {
    return bf16 ? bf16_to_float(float_to_bf16(value)) : value;
}

static inline float load_one(const void *base, int64_t at, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}

static inline void store_one(void *base, int64_t at, int bf16, float value) {
    if (bf16)
        ((uint16_t *)base)[at] = float_to_bf16(value);
    else
        ((float *)base)[at] = value;
}

/* Rows of n elements: to float32 (from `base` at element `at`), back, and rounded in place. The
 * dtype is chosen once per row, so each loop vectorizes. */
static inline void load_row(const void *base, int64_t at, int bf16, float *dst, int64_t n) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + at;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
    } else {
        memcpy(dst, (const float *)base + at, sizeof(float) * n);
    }
}

static inline void store_row(void *base, int64_t at, int bf16, const float *src, int64_t n) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)base + at;
        for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float *)base + at, src, sizeof(float) * n);
    }
}

static inline void round_row(float *values, int bf16, int64_t n) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) values[i] = bf16_to_float(float_to_bf16(values[i]));
}

#endif
