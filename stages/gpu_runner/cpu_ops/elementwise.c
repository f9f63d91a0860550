/* The decode step's elementwise work on the CPU, each a single pass where torch takes several
 * operators: RMSNorm (after the residual add), SwiGLU's silu(gate) * up, rotary embedding.
 *
 * Each rounds where torch's operators round: a bfloat16 result of every operator that the
 * plain-torch path (layers/norm.py, layers/mlp.py, layers/rotary.py) runs in bfloat16 is rounded
 * to bfloat16 here at the same point, and float32 arithmetic is not contracted into fused
 * multiply-adds (-ffp-contract=off). What may differ is the order of the RMS sum's terms and the
 * last bit of exp, as between any two float32 reductions. Rows are shared by the OpenMP threads; one row
 * (a decode step of one stream), and every row on the GGUF decode path (pool.c's), stays on the
 * calling thread.
 * Element types: float32 or bfloat16 (`bf16`), one for all of a call's tensors.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "kernels.h"

/* out = rms_norm(x (+ residual)); with residual_in, residual_out = x + residual_in (rounded)
 * and the norm is of it. weight * normalised: the normalised value rounded first (Llama), or
 * with unit_offset (Gemma) normalised * (1 + weight) in float32, rounded last. Row strides in
 * elements; each row's hidden values are contiguous. */
void rms_norm(const void *x, int64_t x_stride, const void *residual_in, void *residual_out, const void *weight,
              void *out, int64_t rows, int64_t hidden, float eps, int unit_offset, int bf16) {
#pragma omp parallel if (rows > 1 && !pool_entered())
    {
        float *v = malloc(sizeof(float) * hidden), *t = malloc(sizeof(float) * hidden);
        float *w = malloc(sizeof(float) * hidden);
        load_row(weight, 0, bf16, w, hidden);
        if (unit_offset)
            for (int64_t i = 0; i < hidden; i++) w[i] = 1.0f + w[i];
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            load_row(x, row * x_stride, bf16, v, hidden);
            if (residual_in != NULL) {
                load_row(residual_in, row * hidden, bf16, t, hidden);
                for (int64_t i = 0; i < hidden; i++) v[i] += t[i];
                round_row(v, bf16, hidden);
                store_row(residual_out, row * hidden, bf16, v, hidden);
            }
            float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < hidden; i++) squares += v[i] * v[i];
            const float inverse = 1.0f / sqrtf(squares / (float)hidden + eps);
            for (int64_t i = 0; i < hidden; i++) v[i] *= inverse;
            if (!unit_offset) round_row(v, bf16, hidden);
            for (int64_t i = 0; i < hidden; i++) v[i] *= w[i];
            store_row(out, row * hidden, bf16, v, hidden);
        }
        free(v);
        free(t);
        free(w);
    }
}

/* out [rows, width] = silu(gate) * up, gate and up [rows, width] at row strides (elements). */
void silu_and_mul(const void *gate, const void *up, int64_t stride, void *out, int64_t rows, int64_t width,
                  int bf16) {
#pragma omp parallel if (rows > 1 && !pool_entered())
    {
        float *g = malloc(sizeof(float) * width), *u = malloc(sizeof(float) * width);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            load_row(gate, row * stride, bf16, g, width);
            load_row(up, row * stride, bf16, u, width);
            for (int64_t i = 0; i < width; i++) g[i] = g[i] / (1.0f + exp_approx(-g[i]));
            round_row(g, bf16, width);
            for (int64_t i = 0; i < width; i++) g[i] *= u[i];
            store_row(out, row * width, bf16, g, width);
        }
        free(g);
        free(u);
    }
}

/* out [tokens, heads, head_dim] = x * cos + rotate_half(x) * sin (the neox layout: halves), x at
 * token stride `x_stride` (elements; heads contiguous within a token), cos and sin
 * [tokens, head_dim] contiguous. */
void rotary(const void *x, int64_t x_stride, const void *cos_table, const void *sin_table, void *out,
            int64_t tokens, int64_t heads, int64_t head_dim, int bf16) {
    const int64_t half = head_dim / 2, width = heads * head_dim;
#pragma omp parallel if (tokens > 1 && !pool_entered())
    {
        float *v = malloc(sizeof(float) * width), *a = malloc(sizeof(float) * width);
        float *b = malloc(sizeof(float) * width), *c = malloc(sizeof(float) * head_dim);
        float *s = malloc(sizeof(float) * head_dim);
#pragma omp for schedule(static)
        for (int64_t token = 0; token < tokens; token++) {
            load_row(x, token * x_stride, bf16, v, width);
            load_row(cos_table, token * head_dim, bf16, c, head_dim);
            load_row(sin_table, token * head_dim, bf16, s, head_dim);
            for (int64_t h = 0; h < heads; h++) {
                const float *vh = v + h * head_dim;
                float *ah = a + h * head_dim, *bh = b + h * head_dim;
                for (int64_t e = 0; e < half; e++) {
                    ah[e] = vh[e] * c[e];
                    bh[e] = -vh[e + half] * s[e];
                    ah[e + half] = vh[e + half] * c[e + half];
                    bh[e + half] = vh[e] * s[e + half];
                }
            }
            round_row(a, bf16, width);
            round_row(b, bf16, width);
            for (int64_t i = 0; i < width; i++) a[i] += b[i];
            store_row(out, token * width, bf16, a, width);
        }
        free(v);
        free(a);
        free(b);
        free(c);
        free(s);
    }
}
