/* A decode step through a stack of pre-norm decoder layers, each of whose weights is GGUF blocks,
 * in one call on the CPU. A layer (Llama family; Gemma 3 with the norms marked *):
 *
 *     h = rms_norm(x + residual)              residual = x + residual
 *     q, k, v = h W_q, h W_k, h W_v           q, k = rms_norm per head* ; rotary(q), rotary(k)
 *     k, v written to the cache               a = attention(q, the row's keys)
 *     x = a W_o                               x = rms_norm(x)*
 *     h = rms_norm(x + residual)              residual = x + residual
 *     x = (act(h W_gate) * h W_up) W_down     x = rms_norm(x)*
 *
 * and after the last layer out = x + residual. act is SwiGLU's silu (elementwise.c) or a function
 * the caller gives (GeGLU's tanh-approximated gelu: torch's own, in decoder_op.cpp). Each step is
 * the kernel the layer-by-layer path runs (elementwise.c, attention.c, quant.c, quant_x8.c,
 * quant_gemm.c) on the same values in the same order, so the result is that path's to the bit;
 * what goes is the interpreter and the operator dispatch between some ten kernels a layer, which
 * cost a one-stream decode step of a small model more than its products.
 *
 * A layer's attention reads one of the step's key sets (its KV group, and its window: rows of
 * `queries` tokens each, a decode row's one or a row verifying drafts: its last token and the
 * drafts) and one of its rotary tables (Gemma 3's local and global bases). Activations are
 * float32; the cache float32 or bfloat16 (rounded to nearest even as written, as torch converts).
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

/* A merged projection's parts: one weight's product into out [n, total], or each part's into its
 * own contiguous [n, rows_i] run of out, one after another (as the layer path holds them). */
static int products(const quant_weight *parts, int count, const float *x, int64_t n, float *out) {
    for (int i = 0; i < count; i++) {
        if (product(parts + i, x, n, out) != 0) return -1;
        out += n * parts[i].rows;
    }
    return 0;
}

/* q, k, v of the layer's qkv product: where each begins, and the row strides of q and of k and v
 * (the merged product's width, or each part's own). */
static void qkv_views(const decoder_layer *layer, float *qkv, int64_t n, int64_t q_size, int64_t kv_size,
                      float **q, float **k, float **v, int64_t *q_stride, int64_t *kv_stride) {
    if (layer->qkv_parts == 1) {
        *q = qkv, *k = qkv + q_size, *v = qkv + q_size + kv_size;
        *q_stride = *kv_stride = q_size + 2 * kv_size;
        return;
    }
    *q = qkv, *k = qkv + n * q_size, *v = qkv + n * (q_size + kv_size);
    *q_stride = q_size, *kv_stride = kv_size;
}

int decoder_layers(const decoder_layer *layers, int64_t num_layers, const decode_shape *s, const float *x,
                   float *out) {
    const int64_t t = s->tokens, hidden = s->hidden, hd = s->head_dim, inter = s->intermediate;
    const int64_t q_size = s->heads * hd, kv_size = s->kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    float *residual = malloc(sizeof(float) * t * hidden), *h = malloc(sizeof(float) * t * hidden);
    float *cur = malloc(sizeof(float) * t * hidden), *qkv = malloc(sizeof(float) * t * qkv_size);
    float *normed = malloc(sizeof(float) * t * q_size), *q = malloc(sizeof(float) * t * q_size);
    float *k = malloc(sizeof(float) * t * kv_size), *attended = malloc(sizeof(float) * t * q_size);
    float *gate_up = malloc(sizeof(float) * t * 2 * inter), *act = malloc(sizeof(float) * t * inter);
    int status = 0;
    if (!residual || !h || !cur || !qkv || !normed || !q || !k || !attended || !gate_up || !act) abort();
    memcpy(cur, x, sizeof(float) * t * hidden);
    pool_enter(); /* the products and the attention on pool.c's threads, the elementwise work on this one */
    for (int64_t i = 0; i < num_layers; i++) { /* a product that fails (status -1) breaks out */
        const decoder_layer *layer = layers + i;
        const key_set *keys = s->key_sets + layer->key_set;
        const float *cos = s->cos[layer->rope], *sin = s->sin[layer->rope];
        const float eps = s->eps;
        const int unit = s->unit_offset;
        if (i == 0) { /* the first layer's residual is its input */
            memcpy(residual, cur, sizeof(float) * t * hidden);
            rms_norm(cur, hidden, NULL, NULL, layer->input_norm, h, t, hidden, eps, unit, 0);
        } else {
            rms_norm(cur, hidden, residual, residual, layer->input_norm, h, t, hidden, eps, unit, 0);
        }
        if ((status = products(layer->qkv, layer->qkv_parts, h, t, qkv)) != 0) break;
        float *qs, *ks, *vs;
        int64_t q_stride, kv_stride;
        qkv_views(layer, qkv, t, q_size, kv_size, &qs, &ks, &vs, &q_stride, &kv_stride);
        if (layer->q_norm != NULL) { /* per head, each head's values a row; then rotary reads them packed */
            float *k_normed = attended; /* free until the attention */
            for (int64_t token = 0; token < t; token++) {
                rms_norm(qs + token * q_stride, hd, NULL, NULL, layer->q_norm, normed + token * q_size, s->heads, hd,
                         eps, unit, 0);
                rms_norm(ks + token * kv_stride, hd, NULL, NULL, layer->k_norm, k_normed + token * kv_size,
                         s->kv_heads, hd, eps, unit, 0);
            }
            rotary(normed, q_size, cos, sin, q, t, s->heads, hd, 0);
            rotary(k_normed, kv_size, cos, sin, k, t, s->kv_heads, hd, 0);
        } else {
            rotary(qs, q_stride, cos, sin, q, t, s->heads, hd, 0);
            rotary(ks, kv_stride, cos, sin, k, t, s->kv_heads, hd, 0);
        }
        for (int64_t token = 0; token < t; token++) {
            const int64_t slot = keys->slot_mapping[token];
            store_row(layer->keys, slot * kv_size, s->kv_bf16, k + token * kv_size, kv_size);
            store_row(layer->values, slot * kv_size, s->kv_bf16, vs + token * kv_stride, kv_size);
        }
        paged_attention(q, layer->keys, layer->values, keys->key_slots, keys->mask, attended, t / keys->queries,
                        keys->queries, keys->num_keys, s->heads, s->kv_heads, hd, s->scale, 0, s->kv_bf16);
        if ((status = product(&layer->o, attended, t, cur)) != 0) break;
        if (layer->attention_out_norm != NULL) {
            rms_norm(cur, hidden, NULL, NULL, layer->attention_out_norm, h, t, hidden, eps, unit, 0);
            memcpy(cur, h, sizeof(float) * t * hidden);
        }
        rms_norm(cur, hidden, residual, residual, layer->mlp_norm, h, t, hidden, eps, unit, 0);
        if ((status = products(layer->gate_up, layer->gate_up_parts, h, t, gate_up)) != 0) break;
        /* gate and up: one [t, 2 inter] product (row stride 2 inter), or two [t, inter] ones */
        const int merged = layer->gate_up_parts == 1;
        const float *gate = gate_up, *up = merged ? gate_up + inter : gate_up + t * inter;
        const int64_t gate_stride = merged ? 2 * inter : inter;
        if (s->activate != NULL)
            s->activate(gate, up, gate_stride, act, t, inter);
        else
            silu_and_mul(gate, up, gate_stride, act, t, inter, 0);
        if ((status = product(&layer->down, act, t, cur)) != 0) break;
        if (layer->mlp_out_norm != NULL) {
            rms_norm(cur, hidden, NULL, NULL, layer->mlp_out_norm, h, t, hidden, eps, unit, 0);
            memcpy(cur, h, sizeof(float) * t * hidden);
        }
    }
    pool_leave();
    if (status == 0)
        for (int64_t i = 0; i < t * hidden; i++) out[i] = cur[i] + residual[i];
    free(residual);
    free(h);
    free(cur);
    free(qkv);
    free(normed);
    free(q);
    free(k);
    free(attended);
    free(gate_up);
    free(act);
    return status;
}
