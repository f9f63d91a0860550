/* exp for the kernels' softmaxes and activations, in plain float32 arithmetic that vectorizes. */
#ifndef PIPELINE_CPU_KERNELS_EXP_H
#define PIPELINE_CPU_KERNELS_EXP_H

#include <stdint.h>
#include <string.h>

/* exp(x) to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor
 * polynomial, 2^n put into the exponent bits. 0 below -87 (where exp leaves float32's normal
 * range), for -inf and for NaN; inf above 88. */
static inline float exp_approx(float x) {
    /* branch-free (the edges are selected, not branched to), so that the callers' loops vectorize */
    const float y = (x >= -87.0f) & (x <= 88.0f) ? x : 0.0f;
    const float n = __builtin_rintf(y * 1.44269504088896341f);
    const float r = (y - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float value = x >= -87.0f ? p * scale : 0.0f;
    return x > 88.0f ? __builtin_inff() : value;
}

#endif
