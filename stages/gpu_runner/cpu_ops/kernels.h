/* The C kernels' entry points, as ops.cpp calls them (each defined in the .c file named beside it).
 * Layouts and meanings are described where each is defined; ops.cpp checks every argument first. */
#ifndef PIPELINE_CPU_KERNELS_H
#define PIPELINE_CPU_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* pool.c: task(arg, begin, end) for chunks of `grain` items of [0, items): on the pool's threads
 * between pool_enter() and pool_leave() on the calling thread (the GGUF decode path), else on
 * OpenMP's (torch's). pool_grain: a grain, a multiple of `multiple`, that cuts `items` into several
 * chunks a thread. */
typedef void (*pool_task)(void *arg, int64_t begin, int64_t end);
void pool_run(pool_task task, void *arg, int64_t items, int64_t grain);
void pool_enter(void);
void pool_leave(void);
int pool_entered(void);
int64_t pool_grain(int64_t items, int64_t multiple);

/* attention.c */
void paged_attention(const void *query, const void *keys, const void *values, const int64_t *slots,
                     const uint8_t *mask, void *out, int64_t rows, int64_t queries, int64_t num_keys,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int bf16, int kv_bf16);

/* sample.c */
void sample_logits(const float *logits, const float *inverse_temperature, const double *points, int64_t *tokens,
                   int64_t rows, int64_t vocab);

/* elementwise.c */
void rms_norm(const void *x, int64_t x_stride, const void *residual_in, void *residual_out, const void *weight,
              void *out, int64_t rows, int64_t hidden, float eps, int unit_offset, int bf16);
void silu_and_mul(const void *gate, const void *up, int64_t stride, void *out, int64_t rows, int64_t width,
                  int bf16);
void rotary(const void *x, int64_t x_stride, const void *cos_table, const void *sin_table, void *out,
            int64_t tokens, int64_t heads, int64_t head_dim, int bf16);

/* quant.c */
int quant_block_bytes(int qtype);
void quant_dequantize_rows(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t cols, const int64_t *ids,
                           int64_t first, int64_t n, float *out);
void quant_matmul(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t rows, int64_t cols, const float *x,
                  int64_t n, float *out);
void quant_decode_row(const uint8_t *row, int qtype, int64_t cols, float *w);

/* quant_decode_avx2.c, built where QUANT_AVX2 (AVX2, FMA and F16C without AVX-512): one block's
 * values as quant_decode_row gives them; x's block sums [n, cols / 32]; and quant_matmul's fused
 * product of a row with x[j] for j < n (out[j * out_stride]), given those sums (NULL for the types
 * without a minimum: Q4_0, Q5_0, Q8_0, Q6_K) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define QUANT_AVX2 1
#endif
void quant_decode_block_avx2(const uint8_t *b, int qtype, float *w);
void quant_block_sums_avx2(const float *x, int64_t n, int64_t cols, float *sums);
void quant_dot_row_avx2(const uint8_t *row, int qtype, int64_t cols, const float *x, const float *sums, int64_t n,
                        float *out, int64_t out_stride);

/* quant_x8.c */
int quant_x8_available(int qtype);
int quant_matmul_x8(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t rows, int64_t cols, const float *x,
                    int64_t n, float *out);

/* quant_gemm.c */
void quant_matmul_tiled(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t rows, int64_t cols,
                        const float *x, int64_t n, float *out, int64_t tile_rows);

/* quant_encode.c */
int quant_quantize_rows(const float *x, int qtype, int64_t rows, int64_t cols, uint8_t *out);

/* decoder.c: a decode step through a stack of decoder layers of GGUF weights (see there). */
typedef struct {
    const uint8_t *blocks; /* [rows, row_bytes] of block type qtype */
    int64_t row_bytes, rows, cols;
    int qtype, kind;       /* kind: 0 quant.c's fused kernel, 1 8-bit activations (quant_x8.c), 2 quant_gemm.c */
} quant_weight;

/* The keys a layer's tokens attend to: their KV group's (and window's), as rows of `queries` tokens. */
typedef struct {
    const int64_t *slot_mapping; /* [tokens]: where each token's key and value are written */
    const int64_t *key_slots;    /* [tokens / queries, num_keys]: the slots each row reads */
    const uint8_t *mask;         /* [tokens / queries, queries, num_keys]: nonzero where a token sees that key */
    int64_t num_keys, queries;
} key_set;

/* out [rows, width] = act(gate) * up, gate and up [rows, width] at row stride `stride`. */
typedef void (*activation_fn)(const float *gate, const float *up, int64_t stride, float *out, int64_t rows,
                              int64_t width);

typedef struct {
    const float *input_norm, *mlp_norm;                   /* [hidden] */
    const float *attention_out_norm, *mlp_out_norm;       /* [hidden] (Gemma 3's sandwich), or NULL */
    const float *q_norm, *k_norm;                         /* [head_dim] (per-head norms), or NULL */
    quant_weight qkv[3], o, gate_up[2], down;             /* qkv: 1 merged weight or 3 parts; gate_up 1 or 2 */
    int qkv_parts, gate_up_parts, key_set, rope;          /* key_set, rope: indices into decode_shape's */
    void *keys, *values;                                  /* this layer's cache: [slots, kv_heads, head_dim] each */
} decoder_layer;

typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int unit_offset, kv_bf16;
    const float *const *cos, *const *sin; /* per rotary table: [tokens, head_dim] */
    const key_set *key_sets;
    activation_fn activate; /* NULL: SwiGLU (elementwise.c's silu_and_mul) */
} decode_shape;

/* out [tokens, hidden] from x [tokens, hidden]; 0, or -1 where an 8-bit kernel is not built. */
int decoder_layers(const decoder_layer *layers, int64_t num_layers, const decode_shape *shape, const float *x,
                   float *out);

#ifdef __cplusplus
}
#endif

#endif
