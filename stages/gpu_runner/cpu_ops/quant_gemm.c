/* GGUF block-quantized weights times many activation rows (a prefill, a large decode batch).
 *
 * quant_matmul_tiled: out [n, rows] = x [n, cols] times the weight [rows, cols] transposed. Each
 * OpenMP thread takes a tile of `tile_rows` weight rows at a time, decodes it into its own float32
 * buffer (tile_rows x cols, sized to stay in L2; quant.c's decoder, so every value is the reference
 * decoder's float32 bit for bit) and multiplies it with every activation row through a
 * register-blocked micro-kernel: MR activation rows by NR weight rows, MR x NR vector accumulators
 * along the columns, summed across lanes at the end. A tile is decoded once for all n rows, so the
 * decoding costs 1/n of the multiplication. AVX-512 (16 lanes), AVX2 with FMA (8 lanes), or scalar.
 *
 * Only the dot's order of summation differs from a float32 matmul (lanes, then across them).
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
#endif

/* quant.c */
void quant_decode_row(const uint8_t *row, int qtype, int64_t cols, float *w);

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
enum { MR = 4 };
#define LOAD _mm512_loadu_ps
#define FMA _mm512_fmadd_ps
#define ZERO _mm512_setzero_ps
static inline __m256 halves(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
enum { MR = 2 };
#define LOAD _mm256_loadu_ps
#define FMA _mm256_fmadd_ps
#define ZERO _mm256_setzero_ps
static inline __m256 halves(__m256 v) { return v; }
#else
typedef float vec;
#define LANES 1
enum { MR = 2 };
#define LOAD(at) (*(at))
#define FMA(a, b, c) ((a) * (b) + (c))
#define ZERO() 0.0f
#endif
enum { NR = 4 };

/* sums[j] = the sum of acc[j]'s lanes, j < 4 (four at once: fewer shuffles than one at a time). */
static inline void lanes_sum4(const vec *acc, float *sums) {
#if LANES > 1
    const __m256 ab = _mm256_hadd_ps(halves(acc[0]), halves(acc[1]));
    const __m256 cd = _mm256_hadd_ps(halves(acc[2]), halves(acc[3]));
    const __m256 all = _mm256_hadd_ps(ab, cd); /* each sum's two halves, in the two 128-bit lanes */
    _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
#else
    for (int j = 0; j < 4; j++) sums[j] = acc[j];
#endif
}

/* out[i * out_stride + j] (+)= x[i] . w[j] over `depth` columns, for i < m <= MR, j < nr <= NR;
 * x and w rows `cols` apart, depth a multiple of LANES (every block type's 32 or 256 values are).
 * Inlined with constant m and nr, the accumulators stay in registers. */
static inline __attribute__((always_inline)) void micro(const float *x, const float *w, int64_t cols,
                                                        int64_t depth, int m, int nr, float *out,
                                                        int64_t out_stride, int accumulate) {
    vec acc[MR][NR];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = ZERO();
    for (int64_t k = 0; k < depth; k += LANES) {
        vec wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = LOAD(w + j * cols + k);
        for (int i = 0; i < m; i++) {
            const vec xv = LOAD(x + i * cols + k);
            for (int j = 0; j < nr; j++) acc[i][j] = FMA(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < m; i++) {
        float sums[NR];
        lanes_sum4(acc[i], sums);
        for (int j = 0; j < nr; j++) out[i * out_stride + j] = accumulate ? out[i * out_stride + j] + sums[j] : sums[j];
    }
}

/* Columns a pass multiplies: x's MR rows and the weight's NR rows of this many stay in L1. */
enum { DEPTH = 512 };

/* The decoded tile w [tile, cols] times every activation row: out columns [0, tile). Columns in
 * passes of DEPTH, each pass's sums added to the last's. */
static void multiply_tile(const float *x, int64_t n, const float *w, int64_t tile, int64_t cols, float *out,
                          int64_t out_stride) {
    const int64_t depth = cols <= DEPTH * 3 / 2 ? cols : DEPTH;
    for (int64_t k = 0; k < cols; k += depth) {
        const int64_t part = cols - k < depth ? cols - k : depth;
        for (int64_t i = 0; i < n; i += MR) {
            const int m = n - i < MR ? (int)(n - i) : MR;
            for (int64_t j = 0; j < tile; j += NR) {
                const int nr = tile - j < NR ? (int)(tile - j) : NR;
                const float *xi = x + i * cols + k, *wj = w + j * cols + k;
                float *at = out + i * out_stride + j;
                if (m == MR && nr == NR)
                    micro(xi, wj, cols, part, MR, NR, at, out_stride, k > 0);
                else
                    micro(xi, wj, cols, part, m, nr, at, out_stride, k > 0);
            }
        }
    }
}

/* out [n, rows] = x [n, cols] times the weight [rows, cols] transposed, decoded `tile_rows` rows
 * at a time (tile_rows <= 0: a default sized for L2 and the threads). */
void quant_matmul_tiled(const uint8_t *blocks, int qtype, int64_t row_bytes, int64_t rows, int64_t cols,
                        const float *x, int64_t n, float *out, int64_t tile_rows) {
    if (tile_rows <= 0) { /* 256 KiB of float32, and at least 4 tiles a thread where the rows allow */
        const int64_t threads = omp_get_max_threads(), share = (rows + 4 * threads - 1) / (4 * threads);
        tile_rows = (256 * 1024 / 4) / cols;
        if (share < tile_rows) tile_rows = share;
        tile_rows = tile_rows < NR ? NR : (tile_rows + NR - 1) / NR * NR;
    }
    const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
#pragma omp parallel
    {
        float *w = aligned_alloc(64, (size_t)((tile_rows * cols * 4 + 63) / 64 * 64));
        if (w == NULL) abort(); /* a tile: a few hundred KiB */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = t * tile_rows;
            const int64_t count = rows - first < tile_rows ? rows - first : tile_rows;
            for (int64_t r = 0; r < count; r++)
                quant_decode_row(blocks + (first + r) * row_bytes, qtype, cols, w + r * cols);
            multiply_tile(x, n, w, count, cols, out + first, rows);
        }
        free(w);
    }
}
