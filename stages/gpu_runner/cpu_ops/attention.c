/* Paged attention over a step's few-query rows (decodes, and rows verifying drafts) on the CPU.
 *
 * Each row reads its keys in place from the paged cache by slot: no gathered copy of its context,
 * no padding to the batch's longest row (masked keys are skipped, not scored). A task is a chunk
 * of a row's keys (KEY_CHUNK): it scores all the row's query heads against each key once (a key's
 * KV heads are contiguous in its slot), then a softmax within the chunk and the weighted sum of its
 * values, all in float32; a row's chunks are then merged. Tasks are shared by the decode threads
 * (pool.c), so one stream's decode over a long context uses them all; a single chunk runs on the
 * calling thread.
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
/* A row's keys are taken in chunks of this many, each scored, softmaxed against its own highest score
 * and summed over its values alone, then the chunks merged in order: a row of many keys is shared by
 * the threads, and a row's result does not depend on the rows beside it or on the thread count. */
#define KEY_CHUNK 64
#define SCRATCH_FLOATS (1 << 20) /* the chunks' partial results held at once (4 MiB) */

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

/* Keys [j0, j1) of one row, `width` = queries * heads query vectors q [width, head_dim] (already
 * scaled), query i's heads at rows i * heads.. of q; head h reads KV head h / group. Each key is read
 * once for all KV heads (its slot's bytes are contiguous). For each query vector m the chunk leaves
 * top[m] (its highest score, -inf where it sees none of these keys), total[m] = sum exp(s - top[m])
 * and acc [m, head_dim] = sum exp(s - top[m]) v. Scratch: scores [width, KEY_CHUNK], vector
 * [kv_heads * head_dim] (bfloat16 slots widened). */
static void attend_chunk(const float *q, int64_t width, int64_t heads, const void *keys, const void *values,
                         int bf16, const int64_t *slots, const uint8_t *mask, int64_t queries, int64_t num_keys,
                         int64_t j0, int64_t j1, int64_t kv_heads, int64_t head_dim, float *scores, float *vector,
                         float *top, float *total, float *acc) {
    const int64_t group = heads / kv_heads, slot_width = kv_heads * head_dim, n = j1 - j0;
    const int64_t slot_bytes = slot_width * (bf16 ? 2 : 4);
    for (int64_t j = j0; j < j1; j++) {
        fetch_ahead(keys, slots, j, j1, slot_bytes);
        const float *key = seen(mask, queries, num_keys, j) ? slot_row(keys, slots[j], slot_width, bf16, vector) : NULL;
        for (int64_t i = 0; i < queries; i++) {
            const int visible = key != NULL && mask[i * num_keys + j];
            for (int64_t kv = 0; kv < kv_heads; kv++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t m = i * heads + kv * group + g;
                    scores[m * KEY_CHUNK + j - j0] = visible ? dot(q + m * head_dim, key + kv * head_dim, head_dim) : -INFINITY;
                }
        }
    }
    for (int64_t m = 0; m < width; m++) {
        float *s = scores + m * KEY_CHUNK, high = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) high = s[j] > high ? s[j] : high;
        top[m] = high;
        if (high == -INFINITY) { /* sees none of these keys: weights 0 */
            memset(s, 0, sizeof(float) * n);
            total[m] = 0.0f;
            continue;
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            const float p = exp_approx(s[j] - high); /* 0 for masked keys (-inf) */
            s[j] = p;
            sum += p;
        }
        total[m] = sum;
    }
    memset(acc, 0, sizeof(float) * width * head_dim);
    for (int64_t j = j0; j < j1; j++) {
        fetch_ahead(values, slots, j, j1, slot_bytes);
        if (!seen(mask, queries, num_keys, j)) continue;
        const float *value = slot_row(values, slots[j], slot_width, bf16, vector);
        for (int64_t i = 0; i < queries; i++)
            for (int64_t kv = 0; kv < kv_heads; kv++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t m = i * heads + kv * group + g;
                    const float p = scores[m * KEY_CHUNK + j - j0], *vm = value + kv * head_dim;
                    float *am = acc + m * head_dim;
#pragma omp simd
                    for (int64_t e = 0; e < head_dim; e++) am[e] += p * vm[e];
                }
    }
}

/* A row's chunks (`chunks` runs of `per_chunk` floats: top [width], total [width], acc [width,
 * head_dim]) into its output: each chunk's weights rescaled to the row's highest score, in chunk
 * order, then divided by their sum. A query that sees no key gets zeros. */
static void merge_chunks(const float *parts, int64_t chunks, int64_t per_chunk, int64_t width, int64_t head_dim,
                         float *out) {
    for (int64_t m = 0; m < width; m++) {
        float high = -INFINITY, sum = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float t = parts[c * per_chunk + m];
            high = t > high ? t : high;
        }
        float *o = out + m * head_dim;
        memset(o, 0, sizeof(float) * head_dim);
        if (high == -INFINITY) continue;
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = parts + c * per_chunk;
            const float weight = exp_approx(part[m] - high); /* 1 for the highest chunk, 0 for a chunk seeing nothing */
            const float *a = part + 2 * width + m * head_dim;
            sum += weight * part[width + m];
#pragma omp simd
            for (int64_t e = 0; e < head_dim; e++) o[e] += weight * a[e];
        }
        const float inverse = 1.0f / sum;
#pragma omp simd
        for (int64_t e = 0; e < head_dim; e++) o[e] *= inverse;
    }
}

/* One call's arguments and the wave of rows in hand: the threads' tasks read it. */
typedef struct {
    const void *query, *keys, *values;
    const int64_t *slots;
    const uint8_t *mask;
    void *out;
    int64_t queries, num_keys, heads, kv_heads, head_dim, width, chunks, per_chunk, first;
    float scale;
    int bf16, kv_bf16;
    float *parts; /* [wave rows, chunks, per_chunk] */
} attention_job;

/* Tasks [begin, end) of the wave: task = row in the wave * chunks + chunk, a row's chunks in turn. */
static void attend_tasks(void *job_pointer, int64_t begin, int64_t end) {
    const attention_job *j = job_pointer;
    const int64_t width = j->width, head_dim = j->head_dim, chunks = j->chunks;
    float *q = malloc(sizeof(float) * width * head_dim);
    float *scores = malloc(sizeof(float) * width * KEY_CHUNK);
    float *vector = malloc(sizeof(float) * j->kv_heads * head_dim);
    if (q == NULL || scores == NULL || vector == NULL) abort();
    int64_t q_row = -1; /* the row whose scaled queries q holds */
    for (int64_t task = begin; task < end; task++) {
        const int64_t row = j->first + task / chunks, c = task % chunks;
        const int64_t j0 = c * KEY_CHUNK, j1 = j0 + KEY_CHUNK < j->num_keys ? j0 + KEY_CHUNK : j->num_keys;
        float *part = j->parts + task * j->per_chunk;
        if (row != q_row) {
            load_row(j->query, row * width * head_dim, j->bf16, q, width * head_dim);
            for (int64_t e = 0; e < width * head_dim; e++) q[e] *= j->scale;
            q_row = row;
        }
        attend_chunk(q, width, j->heads, j->keys, j->values, j->kv_bf16, j->slots + row * j->num_keys,
                     j->mask + row * j->queries * j->num_keys, j->queries, j->num_keys, j0, j1, j->kv_heads, head_dim,
                     scores, vector, part, part + width, part + 2 * width);
    }
    free(q);
    free(scores);
    free(vector);
}

/* Rows [begin, end) of the wave: their chunks merged and stored. */
static void merge_rows(void *job_pointer, int64_t begin, int64_t end) {
    const attention_job *j = job_pointer;
    float *merged = malloc(sizeof(float) * j->width * j->head_dim);
    if (merged == NULL) abort();
    for (int64_t r = begin; r < end; r++) {
        merge_chunks(j->parts + r * j->chunks * j->per_chunk, j->chunks, j->per_chunk, j->width, j->head_dim, merged);
        store_row(j->out, (j->first + r) * j->width * j->head_dim, j->bf16, merged, j->width * j->head_dim);
    }
    free(merged);
}

void paged_attention(const void *query, const void *keys, const void *values, const int64_t *slots,
                     const uint8_t *mask, void *out, int64_t rows, int64_t queries, int64_t num_keys,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int bf16, int kv_bf16) {
    const int64_t width = queries * heads;  /* query vectors per row */
    const int64_t chunks = num_keys > 0 ? (num_keys + KEY_CHUNK - 1) / KEY_CHUNK : 1;
    const int64_t per_chunk = width * (head_dim + 2);
    /* rows a wave: their chunks' partial results held at once, in about SCRATCH_FLOATS */
    int64_t wave = SCRATCH_FLOATS / (chunks * per_chunk);
    wave = wave < 1 ? 1 : wave > rows ? rows : wave;
    attention_job job = {query, keys, values, slots, mask, out, queries, num_keys, heads, kv_heads, head_dim,
                         width, chunks, per_chunk, 0, scale, bf16, kv_bf16, NULL};
    job.parts = malloc(sizeof(float) * (size_t)(wave * chunks * per_chunk));
    if (job.parts == NULL) abort();
    for (job.first = 0; job.first < rows; job.first += wave) {
        const int64_t count = rows - job.first < wave ? rows - job.first : wave;
        pool_run(attend_tasks, &job, count * chunks, pool_grain(count * chunks, 1));
        pool_run(merge_rows, &job, count, pool_grain(count, 1));
    }
    free(job.parts);
}
