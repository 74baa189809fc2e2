/* Decode attention on the CPU, reading K and V in place from the paged cache.
 *
 * One query token per sequence. A work item is one sequence (or, when there are fewer sequences
 * than threads can share, one KV head of a sequence): for each KV head, its query heads are
 * scored against every key of its context, read block by block through its block table,
 * softmaxed, and used to weigh the values. Keys and values are read once each, with no gathered
 * copy and no padding, and the next block (elsewhere in the pool) is prefetched while the
 * current one is processed. GCC vector extensions give the vectors (LANES floats, one
 * register).
 *
 * The caches are [slots, kv_heads, head_dim] with slot = block * block_size + offset, the
 * layout of bulletserve.kv.pool. The library is compiled per model shape, with HEAD_DIM and
 * GROUP (query heads per KV head) fixed so that the inner loops unroll completely.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vectors of LANES floats, one register each: GCC lowers wider vector types through memory. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#define CACHE_LINE 64

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "compile with -DHEAD_DIM=<head dim> -DGROUP=<query heads per KV head>"
#endif
#if HEAD_DIM % LANES != 0
#error "HEAD_DIM must be a multiple of LANES"
#endif

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

INLINE uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

/* `bf16` is a compile-time constant at every call site, so each exported function gets its own
 * specialized copy of the loops below. */
INLINE float load(const void *p, long i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store(void *p, long i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef int32_t veci __attribute__((vector_size(LANES * 4)));
typedef uint16_t vech __attribute__((vector_size(LANES * 2)));
#define DV (HEAD_DIM / LANES)

INLINE vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void vstore(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* LANES consecutive elements of a cache row, as fp32. */
INLINE vec vload_cache(const void *p, long i, int bf16) {
    if (!bf16) return vload((const float *)p + i);
    vech h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    const veci bits = __builtin_convertvector(h, veci) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* One pairwise level of a sum reduction over LANES vectors: lanes [a's halves summed, b's ...]. */
INLINE vec fold(vec a, vec b, veci even, veci odd) {
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* r[j] = the sum of a[j]'s lanes, for LANES vectors: log2(LANES) levels of shuffles and adds,
 * each halving the vectors and the lanes per vector, instead of LANES horizontal sums. */
#if LANES == 16
INLINE vec reduce_lanes(vec a[16]) {
    const veci l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const veci l1b = l1a + 8;
    const veci l2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const veci l2b = l2a + 4;
    const veci l3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const veci l3b = l3a + 2;
    const veci l4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const veci l4b = l4a + 1;
    vec b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], l1a, l1b);
    for (int i = 0; i < 4; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], l2a, l2b);
    for (int i = 0; i < 2; ++i) d[i] = fold(c[2 * i], c[2 * i + 1], l3a, l3b);
    return fold(d[0], d[1], l4a, l4b);
}
#else
INLINE vec reduce_lanes(vec a[8]) {
    const veci l1a = {0, 1, 2, 3, 8, 9, 10, 11};
    const veci l1b = l1a + 4;
    const veci l2a = {0, 1, 4, 5, 8, 9, 12, 13};
    const veci l2b = l2a + 2;
    const veci l3a = {0, 2, 4, 6, 8, 10, 12, 14};
    const veci l3b = l3a + 1;
    vec b[4], c[2];
    for (int i = 0; i < 4; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], l1a, l1b);
    for (int i = 0; i < 2; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], l2a, l2b);
    return fold(c[0], c[1], l3a, l3b);
}
#endif

INLINE void prefetch_block(const char *block, long bytes) {
    for (long c = 0; c < bytes; c += CACHE_LINE) __builtin_prefetch(block + c);
}

/* Element offset in `cache` of the block holding token t0, after prefetching the block that
 * holds the next block_size tokens, if the context reaches it. */
INLINE long block_at(const void *cache, const int32_t *table, int t0, int len, int block_size,
                     long slot_len, long elem) {
    const int j = t0 / block_size;
    const long block_bytes = (long)block_size * slot_len * elem;
    if (t0 + block_size < len)
        prefetch_block((const char *)cache + (long)table[j + 1] * block_bytes, block_bytes);
    return (long)table[j] * block_size * slot_len;
}

/* Element offset of token t's row for KV head kv. */
INLINE long slot_of(const int32_t *table, int t, int block_size, long slot_len, int kv) {
    return ((long)table[t / block_size] * block_size + t % block_size) * slot_len
           + (long)kv * HEAD_DIM;
}

/* Attention of sequence b's query heads for KV heads [kv_begin, kv_end). Keys go LANES at a
 * time: each key's products with a query head summed into one vector, the LANES vectors
 * reduced together into the LANES scores. Returns 0, or 1 when out of memory. */
INLINE int attend(const void *q, const void *k_cache, const void *v_cache,
                  const int32_t *table, int len, void *out, int b, int kv_begin, int kv_end,
                  int num_heads, int num_kv_heads, int block_size, float scale, int bf16) {
    const long elem = bf16 ? 2 : 4;
    const long slot_len = (long)num_kv_heads * HEAD_DIM; /* elements per slot */
    const int padded = (len + LANES - 1) / LANES * LANES;
    float *scores = malloc(sizeof(float) * (size_t)GROUP * padded);
    if (scores == NULL) return 1;
    for (int kv = kv_begin; kv < kv_end; ++kv) {
        const long q_offset = ((long)b * num_heads + (long)kv * GROUP) * HEAD_DIM;
        vec qv[GROUP][DV];
        for (int g = 0; g < GROUP; ++g)
            for (int d = 0; d < DV; ++d) {
                vec x;
                for (int l = 0; l < LANES; ++l)
                    x[l] = load(q, q_offset + (long)g * HEAD_DIM + d * LANES + l, bf16) * scale;
                qv[g][d] = x;
            }
        float top[GROUP];
        for (int g = 0; g < GROUP; ++g) top[g] = -1e30f;
        for (int t0 = 0; t0 < len; t0 += LANES) {
            if (t0 % block_size == 0) block_at(k_cache, table, t0, len, block_size, slot_len, elem);
            vec partial[GROUP][LANES];
            for (int j = 0; j < LANES; ++j) {
                /* past the context: a copy of the last key, its score dropped below */
                const int t = t0 + j < len ? t0 + j : len - 1;
                const long slot = slot_of(table, t, block_size, slot_len, kv);
                vec k[DV];
                for (int d = 0; d < DV; ++d) k[d] = vload_cache(k_cache, slot + d * LANES, bf16);
                for (int g = 0; g < GROUP; ++g) {
                    vec acc = qv[g][0] * k[0];
                    for (int d = 1; d < DV; ++d) acc += qv[g][d] * k[d];
                    partial[g][j] = acc;
                }
            }
            for (int g = 0; g < GROUP; ++g) {
                const vec s = reduce_lanes(partial[g]);
                vstore(scores + (size_t)g * padded + t0, s);
                const int n = len - t0 < LANES ? len - t0 : LANES;
                for (int j = 0; j < n; ++j) top[g] = s[j] > top[g] ? s[j] : top[g];
            }
        }
        float inv_sum[GROUP];
        for (int g = 0; g < GROUP; ++g) {
            float *s = scores + (size_t)g * padded;
            float sum = 0.0f;
            for (int t = 0; t < len; ++t) {
                s[t] = expf(s[t] - top[g]);
                sum += s[t];
            }
            inv_sum[g] = 1.0f / sum;
        }
        vec acc[GROUP][DV];
        for (int g = 0; g < GROUP; ++g)
            for (int d = 0; d < DV; ++d) acc[g][d] = (vec){0};
        for (int t = 0; t < len; ++t) {
            if (t % block_size == 0) block_at(v_cache, table, t, len, block_size, slot_len, elem);
            const long slot = slot_of(table, t, block_size, slot_len, kv);
            vec v[DV];
            for (int d = 0; d < DV; ++d) v[d] = vload_cache(v_cache, slot + d * LANES, bf16);
            for (int g = 0; g < GROUP; ++g) {
                const vec p = (vec){0} + scores[(size_t)g * padded + t];
                for (int d = 0; d < DV; ++d) acc[g][d] += p * v[d];
            }
        }
        for (int g = 0; g < GROUP; ++g)
            for (int d = 0; d < DV; ++d)
                for (int l = 0; l < LANES; ++l)
                    store(out, q_offset + (long)g * HEAD_DIM + d * LANES + l,
                          acc[g][d][l] * inv_sum[g], bf16);
    }
    free(scores);
    return 0;
}

/* q, out: [batch, num_heads, HEAD_DIM]; caches: [slots, num_kv_heads, HEAD_DIM];
 * block_tables: [batch, max_blocks]; context_lens: [batch]. Returns 0 on success, 1 when out
 * of memory, 2 when the shape does not match the compiled one. */
#define DEFINE_DECODE_ATTENTION(NAME, BF16)                                                       \
    int NAME(const void *q, const void *k_cache, const void *v_cache,                             \
             const int32_t *block_tables, const int32_t *context_lens, void *out, int batch,      \
             int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,       \
             float scale, int num_threads) {                                                      \
        if (head_dim != HEAD_DIM || num_heads != num_kv_heads * GROUP) return 2;                  \
        /* Whole sequences when there are enough to share; else one KV head per item. */        \
        const int parts = batch >= 2 * num_threads ? 1 : num_kv_heads;                           \
        const int per_part = num_kv_heads / parts;                                                \
        int failed = 0;                                                                           \
        _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")                 \
        for (long item = 0; item < (long)batch * parts; ++item) {                                 \
            const int b = (int)(item / parts), part = (int)(item % parts);                       \
            if (attend(q, k_cache, v_cache, block_tables + (long)b * max_blocks,                  \
                       context_lens[b], out, b, part * per_part, (part + 1) * per_part,           \
                       num_heads, num_kv_heads, block_size, scale, BF16))                         \
                failed = 1;                                                                       \
        }                                                                                         \
        return failed;                                                                            \
    }

DEFINE_DECODE_ATTENTION(decode_attention_bf16, 1)
DEFINE_DECODE_ATTENTION(decode_attention_f32, 0)
