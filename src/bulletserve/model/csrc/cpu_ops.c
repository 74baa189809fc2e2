/* Fused element-wise ops of a decoder layer on the CPU: residual add + RMSNorm, rotary
 * embedding (in place), and SiLU(gate) * up. Each replaces a chain of small PyTorch ops, each of
 * which would read and write the activations again and pay a dispatch. Math is in fp32; bf16
 * values are rounded once, on store.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Parallelize only when a call has enough work to pay for waking a thread team. */
#define PARALLEL_MIN_ELEMENTS 32768

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t bf16_store(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    /* Branch-free, so that loops storing bf16 vectorize: NaN stays a (quiet) NaN, others round
     * to nearest even. */
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    const uint32_t nan = (v.u >> 16) | 0x40u;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#define DEFINE_OPS(SUFFIX, T, LOAD, STORE)                                                        \
    /* RMSNorm of rows of x (residual == 0), or of the fp32 residual stream after adding x     \
     * to it in place (x == 0: nothing to add). The stream stays in fp32 across layers, so     \
     * bf16 rounding does not accumulate over them. out = weight * normalized, rounded to T     \
     * after each step as PyTorch would. */                                                     \
    void add_rmsnorm_##SUFFIX(const T *x, float *residual, const T *weight, T *out, long rows,    \
                              long dim, float eps, int num_threads) {                             \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)") \
        for (long r = 0; r < rows; ++r) {                                                         \
            float row[dim];                                                                       \
            if (residual != 0) {                                                                  \
                float *res = residual + r * dim;                                                  \
                if (x != 0)                                                                       \
                    for (long d = 0; d < dim; ++d) res[d] += LOAD(x[r * dim + d]);                \
                for (long d = 0; d < dim; ++d) row[d] = res[d];                                   \
            } else {                                                                              \
                for (long d = 0; d < dim; ++d) row[d] = LOAD(x[r * dim + d]);                     \
            }                                                                                     \
            float sum = 0.0f;                                                                     \
            for (long d = 0; d < dim; ++d) sum += row[d] * row[d];                                \
            const float inv = 1.0f / sqrtf(sum / (float)dim + eps);                               \
            T *o = out + r * dim;                                                                 \
            for (long d = 0; d < dim; ++d)                                                        \
                o[d] = STORE(LOAD(weight[d]) * LOAD(STORE(row[d] * inv)));                        \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* Rotate-half RoPE in place on x[t, head, :] (row stride x_stride, head stride head_dim),    \
     * with fp32 tables cos/sin[position, head_dim / 2]. */                                       \
    void rope_##SUFFIX(T *x, const int64_t *positions, const float *cos_table,                    \
                       const float *sin_table, long tokens, long heads, long head_dim,            \
                       long x_stride, int num_threads) {                                          \
        const long half = head_dim / 2;                                                           \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
        for (long t = 0; t < tokens; ++t) {                                                       \
            const float *c = cos_table + positions[t] * half;                                     \
            const float *s = sin_table + positions[t] * half;                                     \
            for (long h = 0; h < heads; ++h) {                                                    \
                T *v = x + t * x_stride + h * head_dim;                                           \
                for (long d = 0; d < half; ++d) {                                                 \
                    const float a = LOAD(v[d]), b = LOAD(v[d + half]);                           \
                    v[d] = STORE(a * c[d] - b * s[d]);                                            \
                    v[d + half] = STORE(b * c[d] + a * s[d]);                                     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* out[r, :] = silu(gate_up[r, :width]) * gate_up[r, width:]. */                              \
    void silu_mul_##SUFFIX(const T *gate_up, T *out, long rows, long width, int num_threads) {    \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)") \
        for (long r = 0; r < rows; ++r) {                                                         \
            const T *g = gate_up + r * 2 * width;                                                 \
            const T *u = g + width;                                                               \
            T *o = out + r * width;                                                               \
            for (long d = 0; d < width; ++d) {                                                    \
                const float a = LOAD(g[d]);                                                       \
                o[d] = STORE(a / (1.0f + expf(-a)) * LOAD(u[d]));                                 \
            }                                                                                     \
        }                                                                                         \
    }

/* The new tokens' keys and values into their cache slots: row t of k and v (row_len elements,
 * rows k_stride and v_stride apart: column slices of the fused projection) to row slots[t] of
 * the caches.
 * One copy per row, where PyTorch's index_copy_ of a strided source copies it twice. */
#define DEFINE_KV_WRITE(SUFFIX, T)                                                                \
    void kv_write_##SUFFIX(const T *k, const T *v, long k_stride, long v_stride,                  \
                           const int64_t *slots,                                                  \
                           T *k_cache, T *v_cache, long tokens, long row_len, int num_threads) {  \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens * row_len >= PARALLEL_MIN_ELEMENTS)") \
        for (long t = 0; t < tokens; ++t) {                                                       \
            memcpy(k_cache + slots[t] * row_len, k + t * k_stride, sizeof(T) * row_len);          \
            memcpy(v_cache + slots[t] * row_len, v + t * v_stride, sizeof(T) * row_len);          \
        }                                                                                         \
    }

DEFINE_KV_WRITE(bf16, uint16_t)
DEFINE_KV_WRITE(f32, float)
DEFINE_OPS(bf16, uint16_t, bf16_load, bf16_store)
DEFINE_OPS(f32, float, f32_load, f32_store)
