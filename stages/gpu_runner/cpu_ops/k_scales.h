/* Q4_K and Q5_K: the eight 6-bit scales and minimums of a 256-value block, in its bytes 4..16,
 * times the block's d and dmin (quant.c decodes with them, quant_x8.c scales its integer dots). */
#ifndef PIPELINE_CPU_KERNELS_K_SCALES_H
#define PIPELINE_CPU_KERNELS_K_SCALES_H

#include <stdint.h>

static inline void k_scales_of(const uint8_t *b, float d, float dmin, float *scale, float *min) {
    const uint8_t *low = b + 4, *high = b + 8, *mixed = b + 12;
    for (int j = 0; j < 4; j++) {
        scale[j] = d * (float)(low[j] & 0x3f);
        min[j] = dmin * (float)(high[j] & 0x3f);
        scale[j + 4] = d * (float)((mixed[j] & 0x0f) | ((low[j] >> 2) & 0x30));
        min[j + 4] = dmin * (float)((mixed[j] >> 4) | ((high[j] >> 2) & 0x30));
    }
}

#endif
