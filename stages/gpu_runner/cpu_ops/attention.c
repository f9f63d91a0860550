/* Paged attention over a step's few-query rows (decodes, and rows verifying drafts) on the CPU.
 *
 * Each row reads its keys in place from the paged cache by slot: no gathered copy of its context,
 * no padding to the batch's longest row (masked keys are skipped, not scored). One task per row
 * scores all its query heads against each key once (a key's KV heads are contiguous in its
 * slot), then a softmax and the weighted sum of values, all in float32. Tasks are shared by the
 * process's OpenMP threads (torch's own: this library links libgomp by soname, which torch has
 * loaded); a single row, one stream's decode, runs on the calling thread without waking the team.
 *
 * Layouts (C-contiguous; element type float32 or bfloat16, one for query and out (`bf16`) and one
 * for the keys and values (`kv_bf16`: a bfloat16 cache under a float32 model is widened as read):
 * query and out [rows, queries, heads, head_dim]; keys and values [slots, kv_heads, head_dim];
 * slots int64 [rows, num_keys]; mask uint8 [rows, queries, num_keys] (nonzero: the query sees
 * the key). A query that sees no key gets zeros.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__)
#include "avx2.h"
#endif

/* a . b over n floats, n a multiple of 16 (paged_attention's caller checks head_dim). */
static inline float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (int64_t e = 0; e < n; e += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), sum);
    return _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
    /* AVX-512's 16 lanes as two registers, summed in _mm512_reduce_add_ps's order (l + 8, l + 4,
     * l + 2, l + 1): the same float as the AVX-512 path */
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t e = 0; e < n; e += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 8), _mm256_loadu_ps(b + e + 8), hi);
    }
    return sum8(_mm256_add_ps(hi, lo));
#else
    float lanes[16] = {0};
    for (int64_t e = 0; e < n; e += 16)
        for (int64_t l = 0; l < 16; l++) lanes[l] += a[e + l] * b[e + l];
    for (int64_t w = 8; w > 0; w /= 2)
        for (int64_t l = 0; l < w; l++) lanes[l] += lanes[l + w];
    return lanes[0];
#endif
}

#define AHEAD 4  /* keys whose lines are fetched ahead of the one in use */

/* Fetch the cache lines of key j + AHEAD's slot (`slot_bytes` at `base`) ahead of their use. */
static inline void fetch_ahead(const void *base, const int64_t *slots, int64_t j, int64_t num_keys,
                               int64_t slot_bytes) {
    if (j + AHEAD >= num_keys) return;
    const char *at = (const char *)base + slots[j + AHEAD] * slot_bytes;
    for (int64_t offset = 0; offset < slot_bytes; offset += 64) __builtin_prefetch(at + offset);
}

/* Whether any of the row's `queries` sees key j. */
static inline int seen(const uint8_t *mask, int64_t queries, int64_t num_keys, int64_t j) {
    int any = 0;
    for (int64_t i = 0; i < queries; i++) any |= mask[i * num_keys + j];
    return any;
}

/* Key or value j's slot as float32: read in place, or widened from bfloat16 into `vector`. */
static inline const float *slot_row(const void *base, int64_t slot, int64_t slot_width, int bf16, float *vector) {
    if (!bf16) return (const float *)base + slot * slot_width;
    load_row(base, slot * slot_width, bf16, vector, slot_width);
    return vector;
}

/* One row: `width` = queries * heads query vectors q [width, head_dim] (already scaled), query
 * i's heads at rows i * heads.. of q; head h reads KV head h / group. Each key is read once for
 * all KV heads (its slot's bytes are contiguous). Scratch: scores [width, num_keys], vector
 * [kv_heads * head_dim] (bfloat16 slots widened); the result goes to acc [width, head_dim]. */
static void attend(const float *q, int64_t width, int64_t heads, const void *keys, const void *values, int bf16,
                   const int64_t *slots, const uint8_t *mask, int64_t queries, int64_t num_keys,
                   int64_t kv_heads, int64_t head_dim, float *scores, float *vector, float *acc) {
    const int64_t group = heads / kv_heads, slot_width = kv_heads * head_dim;
    const int64_t slot_bytes = slot_width * (bf16 ? 2 : 4);
    for (int64_t j = 0; j < num_keys; j++) {
        fetch_ahead(keys, slots, j, num_keys, slot_bytes);
        const float *key = seen(mask, queries, num_keys, j) ? slot_row(keys, slots[j], slot_width, bf16, vector) : NULL;
        for (int64_t i = 0; i < queries; i++) {
            const int visible = key != NULL && mask[i * num_keys + j];
            for (int64_t kv = 0; kv < kv_heads; kv++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t m = i * heads + kv * group + g;
                    scores[m * num_keys + j] = visible ? dot(q + m * head_dim, key + kv * head_dim, head_dim) : -INFINITY;
                }
        }
    }
    for (int64_t m = 0; m < width; m++) {
        float *s = scores + m * num_keys, top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < num_keys; j++) top = s[j] > top ? s[j] : top;
        if (top == -INFINITY) {  /* sees nothing: zeros */
            memset(s, 0, sizeof(float) * num_keys);
            continue;
        }
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < num_keys; j++) {
            const float p = exp_approx(s[j] - top);  /* 0 for masked keys (-inf) */
            s[j] = p;
            total += p;
        }
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t j = 0; j < num_keys; j++) s[j] *= inverse;
    }
    memset(acc, 0, sizeof(float) * width * head_dim);
    for (int64_t j = 0; j < num_keys; j++) {
        fetch_ahead(values, slots, j, num_keys, slot_bytes);
        if (!seen(mask, queries, num_keys, j)) continue;
        const float *value = slot_row(values, slots[j], slot_width, bf16, vector);
        for (int64_t i = 0; i < queries; i++)
            for (int64_t kv = 0; kv < kv_heads; kv++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t m = i * heads + kv * group + g;
                    const float p = scores[m * num_keys + j], *vm = value + kv * head_dim;
                    float *am = acc + m * head_dim;
#pragma omp simd
                    for (int64_t e = 0; e < head_dim; e++) am[e] += p * vm[e];
                }
    }
}

void paged_attention(const void *query, const void *keys, const void *values, const int64_t *slots,
                     const uint8_t *mask, void *out, int64_t rows, int64_t queries, int64_t num_keys,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int bf16, int kv_bf16) {
    const int64_t width = queries * heads;  /* query vectors per row */
#pragma omp parallel if (rows > 1)
    {
        float *q = malloc(sizeof(float) * width * head_dim);
        float *acc = malloc(sizeof(float) * width * head_dim);
        float *scores = malloc(sizeof(float) * width * num_keys);
        float *vector = malloc(sizeof(float) * kv_heads * head_dim);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            load_row(query, row * width * head_dim, bf16, q, width * head_dim);
            for (int64_t e = 0; e < width * head_dim; e++) q[e] *= scale;
            attend(q, width, heads, keys, values, kv_bf16, slots + row * num_keys, mask + row * queries * num_keys,
                   queries, num_keys, kv_heads, head_dim, scores, vector, acc);
            store_row(out, row * width * head_dim, bf16, acc, width * head_dim);
        }
        free(q);
        free(acc);
        free(scores);
        free(vector);
    }
}
