/* A decode step through a stack of pre-norm decoder layers (the Llama family: attention, then a
 * SwiGLU MLP) in one call, each of whose weights is GGUF blocks, on the CPU:
 *
 *     h = rms_norm(x + residual)            residual = x + residual
 *     q, k, v = h W_qkv                     rotary(q), rotary(k); k, v written to the cache
 *     a = attention(q, the row's keys)      x = a W_o
 *     h = rms_norm(x + residual)            residual = x + residual
 *     x = (silu(h W_gate) * h W_up) W_down
 *
 * and after the last layer out = x + residual. The tokens are rows of `queries` each (a decode row's
 * one, or a row verifying drafts: its last token and the drafts), each row reading its own keys. Each step is the kernel the layer-by-layer path
 * runs (elementwise.c, attention.c, quant.c, quant_x8.c) on the same values in the same order, so
 * the result is that path's to the bit; what goes is the interpreter and the operator dispatch
 * between some ten kernels a layer, which cost a one-stream decode step of a small model more than
 * its products. Activations are float32; the cache float32 or bfloat16 (rounded to nearest even as
 * written, as torch converts).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* out [n, rows] = x [n, cols] times the weight transposed, by the kernel the caller chose for n rows. */
static int product(const quant_weight *w, const float *x, int64_t n, float *out) {
    if (w->kind == 1) return quant_matmul_x8(w->blocks, w->qtype, w->row_bytes, w->rows, w->cols, x, n, out);
    if (w->kind == 2)
        quant_matmul_tiled(w->blocks, w->qtype, w->row_bytes, w->rows, w->cols, x, n, out, 0);
    else
        quant_matmul(w->blocks, w->qtype, w->row_bytes, w->rows, w->cols, x, n, out);
    return 0;
}

int decoder_layers(const decoder_layer *layers, int64_t num_layers, const decode_shape *s, const float *x,
                   float *out) {
    const int64_t t = s->tokens, hidden = s->hidden, hd = s->head_dim;
    const int64_t q_size = s->heads * hd, kv_size = s->kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t inter = s->intermediate;
    float *residual = malloc(sizeof(float) * t * hidden), *h = malloc(sizeof(float) * t * hidden);
    float *cur = malloc(sizeof(float) * t * hidden), *qkv = malloc(sizeof(float) * t * qkv_size);
    float *q = malloc(sizeof(float) * t * q_size), *k = malloc(sizeof(float) * t * kv_size);
    float *attended = malloc(sizeof(float) * t * q_size), *gate_up = malloc(sizeof(float) * t * 2 * inter);
    float *act = malloc(sizeof(float) * t * inter);
    int status = 0;
    if (!residual || !h || !cur || !qkv || !q || !k || !attended || !gate_up || !act) abort(); /* a few KiB */
    memcpy(cur, x, sizeof(float) * t * hidden);
    for (int64_t i = 0; i < num_layers && status == 0; i++) {
        const decoder_layer *layer = layers + i;
        if (i == 0) { /* the first layer's residual is its input */
            memcpy(residual, cur, sizeof(float) * t * hidden);
            rms_norm(cur, hidden, NULL, NULL, layer->input_norm, h, t, hidden, s->eps, s->unit_offset, 0);
        } else {
            rms_norm(cur, hidden, residual, residual, layer->input_norm, h, t, hidden, s->eps, s->unit_offset, 0);
        }
        status = product(&layer->qkv, h, t, qkv);
        if (status != 0) break;
        rotary(qkv, qkv_size, s->cos, s->sin, q, t, s->heads, hd, 0);
        rotary(qkv + q_size, qkv_size, s->cos, s->sin, k, t, s->kv_heads, hd, 0);
        for (int64_t token = 0; token < t; token++) {
            const int64_t slot = s->slot_mapping[token];
            store_row(layer->keys, slot * kv_size, s->kv_bf16, k + token * kv_size, kv_size);
            store_row(layer->values, slot * kv_size, s->kv_bf16, qkv + token * qkv_size + q_size + kv_size, kv_size);
        }
        paged_attention(q, layer->keys, layer->values, s->key_slots, s->mask, attended, t / s->queries, s->queries,
                        s->num_keys, s->heads, s->kv_heads, hd, s->scale, 0, s->kv_bf16);
        status = product(&layer->o, attended, t, cur);
        if (status != 0) break;
        rms_norm(cur, hidden, residual, residual, layer->post_norm, h, t, hidden, s->eps, s->unit_offset, 0);
        status = product(&layer->gate_up, h, t, gate_up);
        if (status != 0) break;
        silu_and_mul(gate_up, gate_up + inter, 2 * inter, act, t, inter, 0);
        status = product(&layer->down, act, t, cur);
    }
    if (status == 0)
        for (int64_t i = 0; i < t * hidden; i++) out[i] = cur[i] + residual[i];
    free(residual);
    free(h);
    free(cur);
    free(qkv);
    free(q);
    free(k);
    free(attended);
    free(gate_up);
    free(act);
    return status;
}
