/* float32 rows into ggml blocks (quantize at load): Q8_0 and Q4_0, bit for bit what ggml's reference
 * quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref; the gguf package's gguf.quants.quantize)
 * give: the same float32 operations in the same order, each rounded (-ffp-contract=off), and the
 * scale rounded to float16 to nearest, ties to even. Out: `rows` runs of cols / 32 blocks.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q8_0 = 8 };

/* value as IEEE float16 bits, rounded to nearest, ties to even (numpy's astype(float16)). */
static uint16_t half_bits(float value) {
    uint32_t f;
    memcpy(&f, &value, sizeof f);
    const uint16_t sign = (uint16_t)((f >> 16) & 0x8000u);
    f &= 0x7fffffffu;
    if (f >= 0x7f800000u) return sign | 0x7c00u | (f > 0x7f800000u ? 0x200u : 0u); /* inf, nan */
    if (f >= 0x477ff000u) return sign | 0x7c00u; /* from 65520 up: rounds to inf */
    if (f <= 0x33000000u) return sign;           /* up to 2^-25: rounds to zero */
    if (f < 0x38800000u) {                       /* below 2^-14: a subnormal, in units of 2^-24 */
        const uint32_t mantissa = (f & 0x7fffffu) | 0x800000u, shift = 126u - (f >> 23);
        const uint32_t units = mantissa >> shift, rest = mantissa & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        return sign | (uint16_t)(units + (rest > mid || (rest == mid && (units & 1u))));
    }
    uint32_t h = (f >> 13) - (112u << 10); /* exponent rebiased, the mantissa's top 10 bits */
    const uint32_t rest = f & 0x1fffu;
    h += rest > 0x1000u || (rest == 0x1000u && (h & 1u));
    return sign | (uint16_t)h;
}

static void put_half(uint8_t *at, float value) {
    const uint16_t h = half_bits(value);
    at[0] = (uint8_t)(h & 0xff);
    at[1] = (uint8_t)(h >> 8);
}

/* d = max|x| / 127; q = x / d rounded half away from zero (np_roundf's floor arithmetic). */
static void q8_0(const float *x, uint8_t *b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
    put_half(b, d);
    for (int i = 0; i < 32; i++) {
        const float scaled = x[i] * id, magnitude = fabsf(scaled), floored = floorf(magnitude);
        const float rounded = floored + floorf(2.0f * (magnitude - floored));
        b[2 + i] = (uint8_t)(int8_t)(int)(scaled < 0.0f ? -rounded : rounded);
    }
}

/* d = (the value of largest magnitude, the first such) / -8; q = trunc(x / d + 8.5) capped at 15;
 * value i in the low nibble of byte i, value i + 16 in its high nibble. */
static void q4_0(const float *x, uint8_t *b) {
    float amax = fabsf(x[0]), max = x[0];
    for (int i = 1; i < 32; i++)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    const float d = max / -8.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
    put_half(b, d);
    for (int i = 0; i < 16; i++) {
        const unsigned low = (unsigned)truncf(x[i] * id + 8.5f), high = (unsigned)truncf(x[i + 16] * id + 8.5f);
        b[2 + i] = (uint8_t)((low < 15u ? low : 15u) | ((high < 15u ? high : 15u) << 4));
    }
}

/* out: x [rows, cols] (cols a multiple of 32) as blocks of `qtype` (Q8_0 or Q4_0), row after row.
 * Returns 0, or -1 for a type it does not make. */
int quant_quantize_rows(const float *x, int qtype, int64_t rows, int64_t cols, uint8_t *out) {
    if (qtype != Q8_0 && qtype != Q4_0) return -1;
    const int bytes = qtype == Q8_0 ? 34 : 18;
    const int64_t blocks = rows * (cols / 32);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < blocks; k++) {
        if (qtype == Q8_0)
            q8_0(x + k * 32, out + k * bytes);
        else
            q4_0(x + k * 32, out + k * bytes);
    }
    return 0;
}
