/* y = x W^T in fp32 with W kept in GGUF's packed blocks (ggml's layouts, as llama.cpp writes
 * them): Q8_0, Q4_0, Q4_1 (32 weights a block) and Q4_K, Q5_K, Q6_K (256 weights a block).
 *
 * A decode step is bound by the bytes it reads, so the weights are read packed and unpacked in
 * registers, for any number of rows. Where the CPU has AVX2, as llama.cpp does, the activations
 * are quantized too, each row to int8 with an fp32 scale per 32 values beside the 32-weight
 * formats (llama.cpp's Q8_0) and per 256 beside the K formats (its Q8_K), so that 32 weights'
 * dot product is two integer instructions (maddubs, madd) instead of unpacking them to fp32 for
 * 4 FMAs per row; a 32-weight group then takes one scaled FMA, a K block (8 or 16 integer
 * sub-block scales applied in int32) one. Each output row's groups are unpacked once per four
 * input rows. Elsewhere the portable path
 * unpacks a chunk of a row into fp32 (in L1) and takes its dot product with every input row,
 * the dequantized matrix's product up to summation order.
 *
 * `quant_dequantize_f32` unpacks whole rows (a prefill's GEMM then runs on them) or chosen rows
 * (an embedding's lookup). Every function returns 0, or 1 for a type or shape it does not take.
 */
/* Built as every kernel is, with -ffast-math, but here without reassociating sums and without
 * contracting a * b + c into FMAs on its own: a row's sums must come out the same whether it is
 * computed alone or among others, and the code inlined per row count was otherwise ordered or
 * contracted differently (the AVX2 path's FMAs are written out). */
#pragma GCC optimize("no-associative-math", "fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: mantissa * 2^-24 */
            float value = (float)mantissa * (1.0f / 16777216.0f);
            memcpy(&bits, &value, 4);
            bits |= sign;
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static void unpack_q8_0(const uint8_t *b, float *y) {
    const float d = half(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; ++i) y[i] = d * q[i];
}

static void unpack_q4_0(const uint8_t *b, float *y) {
    const float d = half(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * ((q[j] & 15) - 8);
        y[j + 16] = d * ((q[j] >> 4) - 8);
    }
}

static void unpack_q4_1(const uint8_t *b, float *y) {
    const float d = half(b), m = half(b + 2);
    const uint8_t *q = b + 4;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * (q[j] & 15) + m;
        y[j + 16] = d * (q[j] >> 4) + m;
    }
}

/* The 6-bit scale and min of sub-block j (0-7) of a Q4_K / Q5_K block's 12 scale bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K: d, dmin (fp16), 12 scale bytes, 128 bytes of nibbles; per 64 weights, 32 bytes: the low
 * nibbles are sub-block 2j, the high ones 2j + 1. Q5_K: the same with 32 bytes of fifth bits
 * before the nibbles (bit 2j of byte l: weight l of sub-block 2j). */
static inline void unpack_k4(const uint8_t *b, float *y, const int five_bits) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *scales = b + 4, *high = b + 16, *q = b + (five_bits ? 48 : 16);
    for (int j = 0; j < 4; ++j, q += 32, y += 64) {
        int s0, m0, s1, m1;
        scale_min_k4(2 * j, scales, &s0, &m0);
        scale_min_k4(2 * j + 1, scales, &s1, &m1);
        const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
        for (int l = 0; l < 32; ++l) {
            const int h0 = five_bits ? ((high[l] >> (2 * j)) & 1) << 4 : 0;
            const int h1 = five_bits ? ((high[l] >> (2 * j + 1)) & 1) << 4 : 0;
            y[l] = d0 * ((q[l] & 15) | h0) - o0;
            y[l + 32] = d1 * ((q[l] >> 4) | h1) - o1;
        }
    }
}

static void unpack_q4_k(const uint8_t *b, float *y) { unpack_k4(b, y, 0); }

static void unpack_q5_k(const uint8_t *b, float *y) { unpack_k4(b, y, 1); }

/* Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16); per 128
 * weights, 64 low bytes and 32 high ones. */
static void unpack_q6_k(const uint8_t *b, float *y) {
    const uint8_t *low = b, *high = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half(b + 208);
    for (int n = 0; n < 2; ++n, low += 64, high += 32, scales += 8, y += 128) {
        for (int half16 = 0; half16 < 2; ++half16) { /* 16 weights share each scale */
            const float d1 = d * scales[half16], d2 = d * scales[half16 + 2];
            const float d3 = d * scales[half16 + 4], d4 = d * scales[half16 + 6];
            for (int l = 16 * half16; l < 16 * half16 + 16; ++l) {
                y[l] = d1 * (((low[l] & 15) | ((high[l] & 3) << 4)) - 32);
                y[l + 32] = d2 * (((low[l + 32] & 15) | (((high[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = d3 * (((low[l] >> 4) | (((high[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = d4 * (((low[l + 32] >> 4) | (((high[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

typedef void (*unpack_fn)(const uint8_t *, float *);

typedef struct {
    unpack_fn unpack;
    int weights, bytes; /* per block */
} format;

static int format_of(int type, format *f) {
    switch (type) {
    case Q8_0: *f = (format){unpack_q8_0, 32, 34}; return 0;
    case Q4_0: *f = (format){unpack_q4_0, 32, 18}; return 0;
    case Q4_1: *f = (format){unpack_q4_1, 32, 20}; return 0;
    case Q4_K: *f = (format){unpack_q4_k, 256, 144}; return 0;
    case Q5_K: *f = (format){unpack_q5_k, 256, 176}; return 0;
    case Q6_K: *f = (format){unpack_q6_k, 256, 210}; return 0;
    default: return 1;
    }
}

static inline void unpack_row(const format *f, const uint8_t *row, long in, float *y) {
    for (long k = 0; k < in; k += f->weights, row += f->bytes) f->unpack(row, y + k);
}

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* y[m * ldy] = dot(w, x[m * ldx]) over `in` (a multiple of 32) for every row m. */
static void dot_rows(const float *w, const float *x, long ldx, float *y, long ldy, long rows,
                     long in) {
    long m = 0;
    for (; m + 4 <= rows; m += 4) {
        const float *x0 = x + m * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (long k = 0; k < in; k += 8) {
            const v8f wk = load8(w + k);
            a0 += wk * load8(x0 + k);
            a1 += wk * load8(x1 + k);
            a2 += wk * load8(x2 + k);
            a3 += wk * load8(x3 + k);
        }
        y[m * ldy] = sum8(a0);
        y[(m + 1) * ldy] = sum8(a1);
        y[(m + 2) * ldy] = sum8(a2);
        y[(m + 3) * ldy] = sum8(a3);
    }
    for (; m < rows; ++m) { /* summed in the order above: a row's result is its own */
        const float *xm = x + m * ldx;
        v8f a0 = {0};
        for (long k = 0; k < in; k += 8) {
            const v8f wk = load8(w + k);
            a0 += wk * load8(xm + k);
        }
        y[m * ldy] = sum8(a0);
    }
}

/* Weights unpacked at a time: 4 KB of fp32, so that the chunk stays in L1 while every input row
 * passes over it (a whole row of a 14,336-wide down projection would not). */
#define CHUNK 1024

/* The portable path: fp32 activations, weights unpacked a chunk at a time. */
static void linear_unpacked(const format f, const uint8_t *w, long row_bytes, const float *x,
                            long ldx, float *y, long ldy, long rows, long out, long in,
                            int threads) {
    const long chunk = in < CHUNK ? in : CHUNK - CHUNK % f.weights;
    const long chunk_bytes = chunk / f.weights * f.bytes;
#pragma omp parallel num_threads(threads)
    {
        float unpacked[CHUNK] __attribute__((aligned(64)));
        float partial[rows];
#pragma omp for schedule(static)
        for (long n = 0; n < out; ++n) {
            const uint8_t *row = w + n * row_bytes;
            for (long m = 0; m < rows; ++m) y[m * ldy + n] = 0.0f;
            for (long k = 0; k < in; k += chunk, row += chunk_bytes) {
                const long width = in - k < chunk ? in - k : chunk;
                unpack_row(&f, row, width, unpacked);
                dot_rows(unpacked, x + k, ldx, partial, 1, rows, width);
                for (long m = 0; m < rows; ++m) y[m * ldy + n] += partial[m];
            }
        }
    }
}


#ifdef __AVX2__
/* Rows of activations quantized per group of `group` values (32 beside the 32-weight formats,
 * 256 beside the K formats, as llama.cpp's Q8_0 and Q8_K): q (int8, `in` a row), and per group
 * the scale d (x ~ d * q); per 32-value group s = d * sum(q) (`group` 32) or per 16 values the
 * integer sums of q, sums16 (`group` 256). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int16_t *sums16;
    long in, group, groups;
} int8_rows;

static void quantize_rows(const float *x, long ldx, long rows, int8_rows *out, int threads) {
    const long group = out->group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; ++r) {
        for (long g = 0; g < out->groups; ++g) {
            const float *v = x + r * ldx + g * group;
            float amax = 0.0f;
            for (long i = 0; i < group; ++i) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = out->q + r * out->in + g * group;
            int sum = 0;
            for (long i = 0; i < group; ++i) {
                q[i] = (int8_t)lrintf(v[i] * inverse);
                sum += q[i];
            }
            out->d[r * out->groups + g] = d;
            if (group == 32) {
                out->s[r * out->groups + g] = d * (float)sum;
                continue;
            }
            int16_t *sums = out->sums16 + (r * out->in + g * group) / 16;
            for (long j = 0; j < group / 16; ++j) {
                int part = 0;
                for (int i = 0; i < 16; ++i) part += q[16 * j + i];
                sums[j] = (int16_t)part;
            }
        }
    }
}

static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* 8 fp32 lanes: the sums of u[i] * s[i] (u unsigned <= 127, s signed) over 4 consecutive i. */
static inline __m256 dot_u8_s8(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones. */
static inline __m256i nibbles16(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }

static inline __m256i high_nibbles(__m256i v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

/* Each kernel below: the dot products of one packed output row with R (1-4) quantized input
 * rows starting at r0, into out[0..R). A group's weights are w = a * u + b (u unsigned); its
 * dot product with an input group is a * d * dot(u, q) + b * s. */
#define ROWS_MAX 4
#define X_GROUP(r, g) (x->q + (r0 + (r)) * x->in + (g) * 32)
#define X_SUMS16(r, g) (x->sums16 + ((r0 + (r)) * x->in) / 16 + (g) * 16)
#define X_D(r, g) (x->d[(r0 + (r)) * x->groups + (g)])
#define X_S(r, g) (x->s[(r0 + (r)) * x->groups + (g)])
#define KERNEL static inline __attribute__((always_inline)) void
#define ACCUMULATE(r, g, u, a, b)                                                     \
    do {                                                                              \
        acc[r] = _mm256_fmadd_ps(dot_u8_s8(u, load32(X_GROUP(r, g))),                 \
                                 _mm256_set1_ps((a) * X_D(r, g)), acc[r]);            \
        offset[r] += (b) * X_S(r, g);                                                 \
    } while (0)

KERNEL row_q4_0(const uint8_t *w, const int8_rows *x, long r0, const int R, float *out) {
    __m256 acc[ROWS_MAX] = {0};
    float offset[ROWS_MAX] = {0};
    for (long g = 0; g < x->groups; ++g, w += 18) {
        const float d = half_f16c(w);
        const __m256i u = nibbles16(w + 2);
        for (int r = 0; r < R; ++r) ACCUMULATE(r, g, u, d, -8.0f * d);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + offset[r];
}

KERNEL row_q4_1(const uint8_t *w, const int8_rows *x, long r0, const int R, float *out) {
    __m256 acc[ROWS_MAX] = {0};
    float offset[ROWS_MAX] = {0};
    for (long g = 0; g < x->groups; ++g, w += 20) {
        const float d = half_f16c(w), m = half_f16c(w + 2);
        const __m256i u = nibbles16(w + 4);
        for (int r = 0; r < R; ++r) ACCUMULATE(r, g, u, d, m);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + offset[r];
}

/* Signed weights: |w| times q with w's sign (maddubs takes one unsigned operand). */
KERNEL row_q8_0(const uint8_t *w, const int8_rows *x, long r0, const int R, float *out) {
    __m256 acc[ROWS_MAX] = {0};
    for (long g = 0; g < x->groups; ++g, w += 34) {
        const float d = half_f16c(w);
        const __m256i q = load32(w + 2), magnitude = _mm256_sign_epi8(q, q);
        for (int r = 0; r < R; ++r) {
            const __m256i signed_x = _mm256_sign_epi8(load32(X_GROUP(r, g)), q);
            acc[r] = _mm256_fmadd_ps(dot_u8_s8(magnitude, signed_x),
                                     _mm256_set1_ps(d * X_D(r, g)), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

/* The K formats, beside activations quantized per 256 values: a block's 8 (Q4_K, Q5_K) or 16
 * (Q6_K) integer sub-block scales multiply its integer dot products in int32 (madd), so a block
 * and row take one conversion to fp32 and one FMA. With u <= 63 and |q| <= 127 every sum fits:
 * maddubs pairs <= 16002 in int16, a block's int32 lanes well within range. */

/* 8 int32 lanes -> fp32, times `scale`, added to acc. */
static inline __m256 scaled_add(__m256i sums, float scale, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), acc);
}

/* A Q4_K / Q5_K block's 12 scale bytes as 8 scales (bytes 0-7) and 8 mins (bytes 8-15), the
 * 6-bit fields of scale_min_k4 gathered word by word in one vector (u0, u1, u2: the 3 words):
 * scales = (u0 & 63s) then (u2 & 15s) | (u0 >> 6) << 4, mins = (u1 & 63s) then
 * (u2 >> 4 & 15s) | (u1 >> 6) << 4. Reads 16 bytes (the block goes on past them). */
static inline __m128i k4_scales_mins(const uint8_t *q) {
    const __m128i u = _mm_loadu_si128((const __m128i *)q);
    const __m128i low = _mm_and_si128(u, _mm_set1_epi8(63)); /* lanes: u0, u1 */
    const __m128i top = _mm_and_si128(_mm_srli_epi32(u, 2), _mm_set1_epi8(0x30));
    const __m128i u2 = _mm_srlv_epi32(_mm_shuffle_epi32(u, 0xAA), _mm_setr_epi32(0, 4, 0, 0));
    const __m128i high = _mm_or_si128(_mm_and_si128(u2, _mm_set1_epi8(15)), top);
    return _mm_unpacklo_epi32(low, high);
}

/* Q4_K and Q5_K: w = d * scale_j * u - dmin * min_j over sub-block j (32 weights, 6-bit scale
 * and min); Q5_K's u has a fifth bit. The min's part is dmin * sum_j min_j * sum(q over j). */
static inline __attribute__((always_inline)) void row_k4(const uint8_t *w, const int8_rows *x,
                                                         long r0, const int R, float *out,
                                                         const int five_bits) {
    __m256 acc[ROWS_MAX] = {0}, acc_min[ROWS_MAX] = {0};
    const int block_bytes = five_bits ? 176 : 144;
    for (long b = 0; b < x->groups; ++b, w += block_bytes) {
        uint32_t d_dmin;
        memcpy(&d_dmin, w, 4);
        const __m128 scale_pair = _mm_cvtph_ps(_mm_cvtsi32_si128((int)d_dmin)); /* d, dmin */
        const uint8_t *packed = w + (five_bits ? 48 : 16);
        const __m256i high = five_bits ? load32(w + 16) : _mm256_setzero_si256();
        const __m128i scales_mins = k4_scales_mins(w + 4);
        /* The 8 scales as int16 in both 128-bit lanes: sub-block j's is broadcast in-lane. */
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales_mins));
        __m256i sums[ROWS_MAX];
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            const __m256i bytes = load32(packed + 32 * (j / 2));
            __m256i u = (j & 1) ? high_nibbles(bytes) : low_nibbles(bytes);
            if (five_bits) {
                const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high, j), _mm256_set1_epi8(1));
                u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
            }
            const short pick = (short)(0x0100 * (2 * j + 1) + 2 * j); /* int16 lane j */
            const __m256i scale = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(pick));
            for (int r = 0; r < R; ++r) {
                const __m256i q = load32(X_GROUP(r, 8 * b + j));
                const __m256i pairs = _mm256_maddubs_epi16(u, q);
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, scale));
            }
        }
        /* Each min twice: the activations' sums are per 16 values. */
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
            scales_mins, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
        for (int r = 0; r < R; ++r) {
            const __m128 scaled = _mm_mul_ps(scale_pair, _mm_set1_ps(X_D(r, b)));
            const __m256i min_sums = _mm256_madd_epi16(mins, load32(X_SUMS16(r, b)));
            const __m256 d_dx = _mm256_broadcastss_ps(scaled);
            const __m256 dmin_dx = _mm256_broadcastss_ps(_mm_movehdup_ps(scaled));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), d_dx, acc[r]);
            acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_sums), dmin_dx, acc_min[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - hsum(acc_min[r]);
}

KERNEL row_q4_k(const uint8_t *w, const int8_rows *x, long r0, const int R, float *out) {
    row_k4(w, x, r0, R, out, 0);
}

KERNEL row_q5_k(const uint8_t *w, const int8_rows *x, long r0, const int R, float *out) {
    row_k4(w, x, r0, R, out, 1);
}

/* Q6_K: w = d * scale * (u - 32), u 6 bits, an int8 scale per 16 weights: the 16 int16 lanes of
 * a 32-weight maddubs are its two halves, so the scale vector holds each half's scale; the 32's
 * part is 32 * sum over the 16 sub-blocks of scale * sum(q). */
KERNEL row_q6_k(const uint8_t *w, const int8_rows *x, long r0, const int R, float *out) {
    __m256 acc[ROWS_MAX] = {0};
    const __m256i mask4 = _mm256_set1_epi8(0x0F), mask_top = _mm256_set1_epi8(0x30);
    for (long b = 0; b < x->groups; ++b, w += 210) {
        const float d = half_f16c(w + 208);
        const int8_t *scales = (const int8_t *)(w + 192);
        /* The 16 scales in the order of the sub-blocks they scale (sub-block i: weights 16i..). */
        const __m128i scales8 = _mm_loadu_si128((const __m128i *)scales);
        const __m256i scales16 = _mm256_cvtepi8_epi16(scales8);
        /* Scales 8n..8n+7 as int16 in both 128-bit lanes: sub-blocks a (low lane) and a + 1
         * (high lane) are then one in-lane shuffle away. */
        const __m256i scales_of[2] = {
            _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales16)),
            _mm256_broadcastsi128_si256(_mm256_extracti128_si256(scales16, 1))};
        __m256i sums[ROWS_MAX];
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        for (int n = 0; n < 2; ++n) {
            const __m256i low0 = load32(w + 64 * n), low1 = load32(w + 64 * n + 32);
            const __m256i high = load32(w + 128 + 32 * n);
            __m256i u[4];
            u[0] = _mm256_and_si256(low0, mask4);
            u[1] = _mm256_and_si256(low1, mask4);
            u[2] = _mm256_and_si256(_mm256_srli_epi16(low0, 4), mask4);
            u[3] = _mm256_and_si256(_mm256_srli_epi16(low1, 4), mask4);
            for (int k = 0; k < 4; ++k) {
                /* Bits 2k, 2k + 1 of each high byte moved to bits 4, 5 (a 16-bit shift: the
                 * mask drops what crossed from the neighbouring byte). */
                const __m256i moved = k < 2 ? _mm256_slli_epi16(high, 4 - 2 * k)
                                            : _mm256_srli_epi16(high, 2 * k - 4);
                u[k] = _mm256_or_si256(u[k], _mm256_and_si256(moved, mask_top));
                const short a = (short)(0x0202 * (2 * k) + 0x0100), b1 = (short)(a + 0x0202);
                const __m256i scale = _mm256_shuffle_epi8(
                    scales_of[n],
                    _mm256_setr_epi16(a, a, a, a, a, a, a, a, b1, b1, b1, b1, b1, b1, b1, b1));
                for (int r = 0; r < R; ++r) {
                    const __m256i q = load32(X_GROUP(r, 8 * b + 4 * n + k));
                    const __m256i pairs = _mm256_maddubs_epi16(u[k], q);
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, scale));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m256i bias = _mm256_madd_epi16(scales16, load32(X_SUMS16(r, b)));
            sums[r] = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(bias, 5));
            acc[r] = scaled_add(sums[r], d * X_D(r, b), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

#define DISPATCH(kernel)                                                                   \
    switch (R) {                                                                           \
    case 4: kernel(w_row, x, r0, 4, sums); break;                                          \
    case 3: kernel(w_row, x, r0, 3, sums); break;                                          \
    case 2: kernel(w_row, x, r0, 2, sums); break;                                          \
    default: kernel(w_row, x, r0, 1, sums); break;                                         \
    }

/* Threads take runs of output rows of at most about L2_BYTES of packed weights, and pass the
 * input rows four at a time over a run: the four rows' activations stay in L1 and the run's
 * weights in L2, rather than every output row streaming all input rows from L2 or L3 (what
 * bounded a prefill's rows). A run is also at most a quarter of a thread's share of the output,
 * so that narrow projections still spread over the threads. */
#define L2_BYTES (256 * 1024)

static void linear_int8(int type, const uint8_t *w, long row_bytes, const int8_rows *x, float *y,
                        long ldy, long rows, long out, int threads) {
    long run = L2_BYTES / row_bytes, share = (out + 4 * threads - 1) / (4 * threads);
    if (run > share) run = share;
    if (run < 1) run = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n0 = 0; n0 < out; n0 += run) {
        const long n1 = out - n0 < run ? out : n0 + run;
        for (long r0 = 0; r0 < rows; r0 += ROWS_MAX) {
            const int R = rows - r0 < ROWS_MAX ? (int)(rows - r0) : ROWS_MAX;
            for (long n = n0; n < n1; ++n) {
                const uint8_t *w_row = w + n * row_bytes;
                float sums[ROWS_MAX] = {0};
                switch (type) {
                case Q4_0: DISPATCH(row_q4_0); break;
                case Q4_1: DISPATCH(row_q4_1); break;
                case Q8_0: DISPATCH(row_q8_0); break;
                case Q4_K: DISPATCH(row_q4_k); break;
                case Q5_K: DISPATCH(row_q5_k); break;
                default: DISPATCH(row_q6_k); break;
                }
                for (int r = 0; r < R; ++r) y[(r0 + r) * ldy + n] = sums[r];
            }
        }
    }
}
#endif

/* Whether `quant_linear_f32` quantizes the activations to int8 (the AVX2 path). */
int quant_linear_int8_activations(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* y[m, n] = sum_k x[m, k] W[n, k] for m < rows, n < out. w: out rows of `row_bytes` packed
 * bytes; x: fp32 rows of stride ldx; y: fp32 rows of stride ldy. `int8_activations`: take the
 * AVX2 path where it was compiled (else the portable one). */
int quant_linear_f32(int type, const uint8_t *w, long row_bytes, const float *x, long ldx,
                     float *y, long ldy, long rows, long out, long in, int int8_activations,
                     int threads) {
    format f;
    if (format_of(type, &f) || in % f.weights || row_bytes != in / f.weights * f.bytes)
        return 1;
    if (!int8_activations || !quant_linear_int8_activations()) {
        linear_unpacked(f, w, row_bytes, x, ldx, y, ldy, rows, out, in, threads);
        return 0;
    }
#ifdef __AVX2__
    const long group = f.weights; /* 32 or 256: llama.cpp's Q8_0 or Q8_K beside the format */
    int8_rows quantized = {malloc(rows * in),
                           malloc(rows * in / group * sizeof(float)),
                           group == 32 ? malloc(rows * in / group * sizeof(float)) : NULL,
                           group == 256 ? malloc(rows * in / 16 * sizeof(int16_t)) : NULL,
                           in,
                           group,
                           in / group};
    if (!quantized.q || !quantized.d || !(quantized.s || quantized.sums16)) {
        free(quantized.q);
        free(quantized.d);
        free(quantized.s);
        free(quantized.sums16);
        return 2;
    }
    quantize_rows(x, ldx, rows, &quantized, threads);
    linear_int8(type, w, row_bytes, &quantized, y, ldy, rows, out, threads);
    free(quantized.q);
    free(quantized.d);
    free(quantized.s);
    free(quantized.sums16);
#endif
    return 0;
}

/* out[i] = row ids[i] of W unpacked (ids: NULL for rows 0..count-1), out: fp32 [count, in]. */
int quant_dequantize_f32(int type, const uint8_t *w, long row_bytes, const int64_t *ids,
                         long count, long in, float *out, int threads) {
    format f;
    if (format_of(type, &f) || in % f.weights || row_bytes != in / f.weights * f.bytes)
        return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < count; ++i)
        unpack_row(&f, w + (ids ? ids[i] : i) * row_bytes, in, out + i * in);
    return 0;
}
