/* A token per row of fp32 logits [rows, vocab], at a temperature, without top-k or top-p: the
 * argmax at temperature 0, else the inverse-CDF draw of the sampler's PyTorch path
 * (engine/sampler.py) in two passes over the row: its maximum, then exp((x - max) / T) summed in
 * blocks of CDF_BLOCK entries; the draw finds its block from the block sums and walks only that
 * block again. PyTorch's path reads and writes the row five times (max, subtract, divide,
 * exp, block sums) and takes a tensor op each. Entries of -inf (masked: a grammar's, or stop
 * tokens before min_tokens) have no mass; a row with a NaN or +inf entry, or with every entry
 * masked, gets -1: the caller draws it through PyTorch, which defines what such a row yields.
 *
 * mask_rows_f32 writes those -inf entries for structured outputs: every token whose bit in the
 * row's grammar bitmask is clear.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CDF_BLOCK 1024

/* Whether x is +inf or NaN (-inf is a masked entry), from its bits: -ffast-math lets the
 * compiler assume neither exists. */
static inline int bad_entry(float x) {
    union { float f; uint32_t u; } v = {x};
    return (v.u & 0x7f800000u) == 0x7f800000u && v.u != 0xff800000u;
}

static inline float negative_infinity(void) {
    union { uint32_t u; float f; } v = {0xff800000u};
    return v.f;
}

static inline int is_negative_infinity(float x) {
    union { float f; uint32_t u; } v = {x};
    return v.u == 0xff800000u;
}

static long sample_row(const float *row, long vocab, float inv_temperature, double uniform,
                       double *block_sums) {
    float max = row[0];
    int bad = 0;
    for (long i = 0; i < vocab; ++i) { /* vectorizes: no index kept */
        bad |= bad_entry(row[i]);
        max = row[i] > max ? row[i] : max;
    }
    if (bad || is_negative_infinity(max)) return -1;
    if (inv_temperature == 0.0f) {
        long argmax = 0;
        while (row[argmax] != max) ++argmax;
        return argmax;
    }
    const long blocks = (vocab + CDF_BLOCK - 1) / CDF_BLOCK;
    double total = 0.0;
    for (long b = 0; b < blocks; ++b) {
        const long end = (b + 1) * CDF_BLOCK < vocab ? (b + 1) * CDF_BLOCK : vocab;
        float sum = 0.0f;
        for (long i = b * CDF_BLOCK; i < end; ++i) sum += expf((row[i] - max) * inv_temperature);
        block_sums[b] = sum;
        total += sum;
    }
    /* The first entry whose cumulative weight exceeds uniform * total, never one without mass:
     * a target at or past the total (rounding) takes the last entry with any. */
    const double target = uniform * total;
    double before = 0.0;
    long last_block = 0;
    for (long b = 0; b < blocks; ++b)
        if (block_sums[b] > 0.0) last_block = b;
    long block = last_block;
    for (long b = 0; b < last_block; ++b) {
        if (before + block_sums[b] > target) {
            block = b;
            break;
        }
        before += block_sums[b];
    }
    const long start = block * CDF_BLOCK;
    const long end = start + CDF_BLOCK < vocab ? start + CDF_BLOCK : vocab;
    double cumulative = before;
    long last = start;
    for (long i = start; i < end; ++i) {
        const double weight = expf((row[i] - max) * inv_temperature);
        if (weight > 0.0) last = i;
        cumulative += weight;
        if (cumulative > target && weight > 0.0) return i;
    }
    return last;
}

/* tokens[r] for each row r: inv_temperatures[r] == 0 for the argmax, uniforms[r] in [0, 1]. */
void sample_rows_f32(const float *logits, long rows, long vocab, const float *inv_temperatures,
                     const double *uniforms, int64_t *tokens, int num_threads) {
    const long blocks = (vocab + CDF_BLOCK - 1) / CDF_BLOCK;
    #pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        double *block_sums = malloc(sizeof(double) * (size_t)blocks);
        #pragma omp for schedule(static)
        for (long r = 0; r < rows; ++r)
            tokens[r] = sample_row(logits + r * vocab, vocab, inv_temperatures[r], uniforms[r],
                                   block_sums);
        free(block_sums);
    }
}

/* For each listed row, -inf over every entry whose bit is clear in that row's bitmask (int32
 * words, bit j of word w for entry 32 w + j; row k of the bitmask for rows[k]). */
void mask_rows_f32(float *logits, long vocab, const int64_t *rows, long count,
                   const int32_t *bitmask, long words, int num_threads) {
    const float masked = negative_infinity();
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (count > 1)
    for (long k = 0; k < count; ++k) {
        float *row = logits + rows[k] * vocab;
        const uint32_t *bits = (const uint32_t *)bitmask + k * words;
        for (long w = 0; w < words; ++w) {
            const uint32_t word = bits[w];
            if (word == 0xffffffffu) continue;
            const long base = w * 32;
            const long end = base + 32 < vocab ? base + 32 : vocab;
            for (long j = base; j < end; ++j)
                if (!((word >> (j - base)) & 1u)) row[j] = masked;
        }
    }
}
