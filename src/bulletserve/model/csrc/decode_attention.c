/* Decode attention on the CPU, reading K and V in place from the paged cache.
 *
 * One query token per sequence. A work item is one sequence (or, when there are fewer sequences
 * than threads can share, one KV head of a sequence): its queries are scored against every key
 * of its context, read block by block through its block table, softmaxed, and used to weigh the
 * values. Keys and values are read once each, with no gathered copy and no padding; each
 * block's rows are contiguous, and the next block (elsewhere in the pool) is prefetched while
 * the current one is processed, because the decode step is bound by memory latency.
 *
 * The caches are [slots, kv_heads, head_dim] with slot = block * block_size + offset, the
 * layout of bulletserve.kv.pool. The library is compiled per model shape, with HEAD_DIM and
 * GROUP (query heads per KV head) fixed so that the inner loops unroll completely.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
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

/* Dot product with LANES independent accumulators, so it vectorizes without reassociation. */
INLINE float dot(const float *a, const float *b) {
    float acc[LANES] = {0};
    for (int d = 0; d < HEAD_DIM; d += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += a[d + l] * b[d + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; ++l) s += acc[l];
    return s;
}

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

/* Attention of sequence b's query heads for KV heads [kv_begin, kv_end). Returns 0, or 1 when
 * out of memory. */
INLINE int attend(const void *q, const void *k_cache, const void *v_cache,
                  const int32_t *table, int len, void *out, int b, int kv_begin, int kv_end,
                  int num_heads, int num_kv_heads, int block_size, float scale, int bf16) {
    const long elem = bf16 ? 2 : 4;
    const long slot_len = (long)num_kv_heads * HEAD_DIM; /* elements per slot */
    const int heads = (kv_end - kv_begin) * GROUP;        /* query heads of this item */
    const long head_begin = (long)kv_begin * GROUP;
    const long row_begin = (long)kv_begin * HEAD_DIM, row_len = (long)(kv_end - kv_begin) * HEAD_DIM;
    float *scores = malloc(sizeof(float) * ((size_t)heads * len + 2 * (size_t)heads * HEAD_DIM
                                            + (size_t)row_len + heads));
    if (scores == NULL) return 1;
    float *qf = scores + (size_t)heads * len; /* [heads, HEAD_DIM], pre-scaled */
    float *acc = qf + (size_t)heads * HEAD_DIM;
    float *row = acc + (size_t)heads * HEAD_DIM; /* one slot's keys or values, as float */
    float *inv_sum = row + row_len;

    const long q_offset = ((long)b * num_heads + head_begin) * HEAD_DIM;
    for (long i = 0; i < (long)heads * HEAD_DIM; ++i) qf[i] = load(q, q_offset + i, bf16) * scale;

    for (int t0 = 0; t0 < len; t0 += block_size) {
        const long block = block_at(k_cache, table, t0, len, block_size, slot_len, elem);
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int o = 0; o < n; ++o) {
            const long slot = block + o * slot_len + row_begin;
            for (long d = 0; d < row_len; ++d) row[d] = load(k_cache, slot + d, bf16);
            for (int h = 0; h < heads; ++h)
                scores[(size_t)h * len + t0 + o] = dot(qf + (size_t)h * HEAD_DIM,
                                                       row + (h / GROUP) * HEAD_DIM);
        }
    }
    for (int h = 0; h < heads; ++h) {
        float *s = scores + (size_t)h * len;
        float m = s[0];
        for (int t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
        for (int t = 0; t < len; ++t) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        inv_sum[h] = 1.0f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)heads * HEAD_DIM);
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const long block = block_at(v_cache, table, t0, len, block_size, slot_len, elem);
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int o = 0; o < n; ++o) {
            const long slot = block + o * slot_len + row_begin;
            for (long d = 0; d < row_len; ++d) row[d] = load(v_cache, slot + d, bf16);
            for (int h = 0; h < heads; ++h) {
                const float p = scores[(size_t)h * len + t0 + o];
                const float *r = row + (h / GROUP) * HEAD_DIM;
                float *a = acc + (size_t)h * HEAD_DIM;
                for (int d = 0; d < HEAD_DIM; ++d) a[d] += p * r[d];
            }
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int d = 0; d < HEAD_DIM; ++d)
            store(out, q_offset + (long)h * HEAD_DIM + d, acc[(size_t)h * HEAD_DIM + d] * inv_sum[h],
                  bf16);
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
