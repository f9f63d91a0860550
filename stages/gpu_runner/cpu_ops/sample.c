/* Sampling a token per row from float32 logits on the CPU, by inverting the row's cumulative
 * distribution at one point: token i with probability exp(l_i / t) / sum_j exp(l_j / t).
 *
 * Two passes over the vocabulary per row: the total of exp((l - max) / t) (float32 sums of
 * BLOCK tokens, added in float64), then the same block sums again up to the block that holds
 * point * total, scanned token by token. Both passes compute each term with the same float32
 * exp in the same order, so the second lands where the first's total says. -inf logits
 * (filtered tokens) weigh 0 and are never drawn. Rows are shared by the OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"
#include "kernels.h"

#define BLOCK 64  /* tokens whose weights the second pass sums at once before it scans them */

/* The weights exp((l - top) * scale) of tokens [start, end), summed in float32. */
static inline float block_weight(const float *l, int64_t start, int64_t end, float top, float scale) {
    float block = 0.0f;
#pragma omp simd reduction(+ : block)
    for (int64_t i = start; i < end; i++) block += exp_approx((l[i] - top) * scale);
    return block;
}

/* logits [rows, vocab]; inverse_temperature and points (in [0, 1)) [rows]; tokens [rows] out. */
void sample_logits(const float *logits, const float *inverse_temperature, const double *points, int64_t *tokens,
                   int64_t rows, int64_t vocab) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        const float *l = logits + row * vocab, scale = inverse_temperature[row];
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < vocab; i++) top = l[i] > top ? l[i] : top;
        /* Both passes add the same float block sums in the same order, so the second reaches
         * the first's total exactly. */
        double total = 0.0;
        for (int64_t start = 0; start < vocab; start += BLOCK)
            total += block_weight(l, start, start + BLOCK < vocab ? start + BLOCK : vocab, top, scale);
        const double target = points[row] * total;
        double running = 0.0;
        int64_t token = -1;
        for (int64_t start = 0; start < vocab && token < 0; start += BLOCK) {
            const int64_t end = start + BLOCK < vocab ? start + BLOCK : vocab;
            const float block = block_weight(l, start, end, top, scale);
            if (running + block <= target && end < vocab) {
                running += block;
                continue;
            }
            /* The point lies in this block (or it is the last): the first token past it, else the
             * block's last token of weight > 0. */
            for (int64_t i = start; i < end; i++) {
                const float weight = exp_approx((l[i] - top) * scale);
                if (weight > 0.0f) {
                    token = i;
                    running += weight;
                    if (running > target) break;
                }
            }
        }
        if (token < 0)  /* only where rounding put the point at the very end: the likeliest token */
            for (token = 0; token < vocab - 1 && !(l[token] >= top); token++) {}
        tokens[row] = token;
    }
}
