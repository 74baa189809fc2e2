/* A token per row of fp32 logits [rows, vocab], at a temperature, without top-k or top-p: the
 * argmax at temperature 0, else the inverse-CDF draw of the sampler's PyTorch path
 * (engine/sampler.py) in two passes over the row: its maximum, then exp((x - max) / T) summed in
 * blocks of CDF_BLOCK entries; the draw finds its block from the block sums and walks only that
 * block again. PyTorch's path reads and writes the row five times (max, subtract, divide,
 * exp, block sums) and takes a tensor op each. A row with a non-finite entry gets -1: the caller
 * draws it through PyTorch, which defines what such a row yields.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CDF_BLOCK 1024

/* Whether x is inf or NaN, from its bits (-ffast-math lets the compiler assume neither). */
static inline int non_finite(float x) {
    union { float f; uint32_t u; } v = {x};
    return (v.u & 0x7f800000u) == 0x7f800000u;
}

static long sample_row(const float *row, long vocab, float inv_temperature, double uniform,
                       double *block_sums) {
    float max = row[0];
    int bad = 0;
    for (long i = 0; i < vocab; ++i) { /* vectorizes: no index kept */
        bad |= non_finite(row[i]);
        max = row[i] > max ? row[i] : max;
    }
    if (bad) return -1;
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
