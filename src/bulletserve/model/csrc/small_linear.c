/* y = x W^T (+ bias) in fp32 for a few rows of x: a decode step's projections.
 *
 * With a handful of rows a linear layer is one pass over its weights, and its speed is how well
 * that pass streams. PyTorch's BLAS on some CPUs (MKL on AMD's, measured in
 * scripts/small_linear_rows.py) runs these shapes at a fraction of the memory bandwidth. Here each
 * thread takes a contiguous range of output columns (rows of W, read once from memory) and keeps
 * a tile of 4 rows x 2 columns of 8-wide partial sums in registers: 6 vector loads per 8 FMAs,
 * the x rows and the current 2 W rows staying in L1 while the next 2 are prefetched (a single
 * thread otherwise waits on memory in the first pass over a block and computes in the others).
 * Tiles were chosen by timing a whole SmolLM2-135M step's projections on an AMD EPYC (Zen 3),
 * one-off: 4 x 2 and 4 x 3 were fastest at 4 and 8 rows, 2 x 4 within 10%.
 *
 * Each output is summed over k in the same order whatever the number of rows, so a row's result
 * does not depend on the batch it is in.
 */
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

#define TILE_ROWS 4
#define TILE_COLS 2

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* rows x cols outputs (at most TILE_ROWS x TILE_COLS); inlined with constant sizes so that the
 * accumulators live in registers. `next` (or 0): the W rows to prefetch meanwhile. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w,
                                                       const float *bias, float *y, long in,
                                                       long out, const int rows, const int cols,
                                                       const float *next) {
    v8f acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j) acc[i][j] = (v8f){0};
    long k = 0;
    for (; k + 8 <= in; k += 8) {
        if (next != 0 && (k & 15) == 0) /* one 64-byte line per 16 floats */
            for (int j = 0; j < cols; ++j) __builtin_prefetch(next + j * in + k, 0, 0);
        v8f wv[TILE_COLS];
        for (int j = 0; j < cols; ++j) wv[j] = load8(w + j * in + k);
        for (int i = 0; i < rows; ++i) {
            const v8f xv = load8(x + i * in + k);
            for (int j = 0; j < cols; ++j) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j) {
            float sum = hsum(acc[i][j]);
            for (long kk = k; kk < in; ++kk) sum += x[i * in + kk] * w[j * in + kk];
            y[i * out + j] = bias != 0 ? sum + bias[j] : sum;
        }
}

/* x: [rows, in]; w: [out, in]; bias: [out] or 0; y: [rows, out]; all contiguous fp32. */
void small_linear_f32(const float *x, const float *w, const float *bias, float *y, long rows,
                      long in, long out, int num_threads) {
    const long blocks = (out + TILE_COLS - 1) / TILE_COLS;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (long b = 0; b < blocks; ++b) {
        const long n = b * TILE_COLS;
        const float *wb = w + n * in;
        const float *bb = bias != 0 ? bias + n : 0;
        if (n + TILE_COLS <= out) {
            const float *next = n + 2 * TILE_COLS <= out ? wb + TILE_COLS * in : 0;
            float *yb = y + n;
            long m = 0;
            for (; m + TILE_ROWS <= rows; m += TILE_ROWS)
                tile(x + m * in, wb, bb, yb + m * out, in, out, TILE_ROWS, TILE_COLS, next);
            for (; m + 2 <= rows; m += 2)
                tile(x + m * in, wb, bb, yb + m * out, in, out, 2, TILE_COLS, next);
            if (m < rows) tile(x + m * in, wb, bb, yb + m * out, in, out, 1, TILE_COLS, next);
        } else {
            for (long c = n; c < out; ++c)
                for (long m = 0; m < rows; ++m)
                    tile(x + m * in, w + c * in, bias != 0 ? bias + c : 0, y + m * out + c, in,
                         out, 1, 1, 0);
        }
    }
}
