/* Prefill attention on the CPU, reading K and V in place from the paged cache (flash-style).
 *
 * Each sequence computes `query_len` new tokens after `cached_len` cached ones (a whole prompt,
 * or a chunk of one after earlier chunks); its new keys and values are already in the cache. A
 * work item is one sequence, one KV head and a chunk of QUERY_CHUNK query tokens: its rows are
 * (token, query head of that KV head) pairs. Keys are taken KEY_SPAN at a time: converted to
 * fp32 once per item, K transposed to [HEAD_DIM][keys] so that a row's scores for KEY_TILE keys
 * are one vector of fused multiply-adds over the head dimension, V as [keys][HEAD_DIM]. Rows go
 * ROW_BLOCK at a time over the span's key tiles with an online softmax (running max and sum),
 * their accumulators in registers; tiles past a row's causal limit are skipped, and only the
 * tiles that straddle it are masked. PyTorch's CPU flash attention ran this shape (head dim 64,
 * 9 heads over 3 KV heads) at about 80 GFLOP/s on two Zen 5 cores, a tenth of their GEMM peak.
 *
 * The caches are [slots, kv_heads, HEAD_DIM] with slot = block * block_size + offset, the
 * layout of bulletserve.kv.pool. GCC vector extensions give the vectors (VL lanes, one
 * register). Compiled per model shape (HEAD_DIM, GROUP). bf16 has two more paths: pairs of
 * bf16 multiplied in AVX-512 bf16 vectors, and where the CPU has AMX, the scores and the
 * weighted values as tile products (`attend_rows_amx`; 0.73-0.81x the time of PyTorch's SDPA,
 * itself on AMX, on an AMX Xeon's two cores at 256-2,048 tokens).
 */
#include <math.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "compile with -DHEAD_DIM=<head dim> -DGROUP=<query heads per KV head>"
#endif

#define KEY_SPAN 512    /* keys converted to fp32 at a time (K^T and V: 256 KB at head dim 64) */
#define QUERY_CHUNK 64  /* query tokens per work item (twice that on AMX tiles) */
/* Vectors of VL floats, one register each: GCC lowers wider vector types through memory. Sized
 * so that a block's scores and outputs stay in registers (32 of them with AVX-512, 16 with
 * AVX2): ROW_BLOCK rows are accumulated together, the scores of KEY_TILE keys each (TV
 * vectors), then DCHUNK vectors of output columns each at a time. */
#ifdef __AVX512F__
#define VL 16
#define ROW_BLOCK 6
#define KEY_TILE 64
#define DCHUNK (HEAD_DIM / VL)
#else
#define VL 8
#define ROW_BLOCK 6
#define KEY_TILE 8
#define DCHUNK 2
#endif
#define TV (KEY_TILE / VL)
#define DV (HEAD_DIM / VL)
/* The score of a masked key: finite, as -ffast-math assumes no infinities. */
#define MASKED -1e30f

#if HEAD_DIM % 16 != 0
#error "HEAD_DIM must be a multiple of 16"
#endif

typedef float vec __attribute__((vector_size(VL * 4)));
typedef int32_t veci __attribute__((vector_size(VL * 4)));

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

INLINE float load(const void *p, long i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store(void *p, long i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

INLINE vec splat(float x) { return (vec){0} + x; }

INLINE vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void vstore(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros). */
INLINE vec vselect(veci mask, vec a, vec b) {
    veci ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const veci ri = (ai & mask) | (bi & ~mask);
    vec r;
    memcpy(&r, &ri, sizeof r);
    return r;
}

INLINE float hmax(vec v) {
    float m = v[0];
    for (int i = 1; i < VL; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

INLINE float hsum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < VL; ++i) s += v[i];
    return s;
}

/* exp(x) for x <= 0 (scores minus their running max), 0 at and below -87: 2^n * p(r) with
 * n = trunc(x / ln2), r = x - n ln2 in (-ln2, 0], p a degree-7 Taylor polynomial (relative
 * error below 2e-6). */
INLINE vec vexp(vec x) {
    const vec clamped = vselect(x < -87.0f, splat(-87.0f), x);
    const veci n = __builtin_convertvector(clamped * 1.44269504088896341f, veci);
    const vec nf = __builtin_convertvector(n, vec);
    const vec r = clamped - nf * 0.693145751953125f - nf * 1.42860682030941723212e-6f;
    vec p = splat(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const veci bits = (n + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return vselect(x <= -87.0f, splat(0.0f), p * scale);
}

typedef struct {
    const void *q;
    const void *k_cache, *v_cache;
    void *out;
    const int32_t *block_tables;
    long q_stride; /* elements between query rows (a column slice of the fused projection) */
    int max_blocks, num_heads, num_kv_heads, block_size;
    float scale;
} Args;

/* K^T tile by tile ([KEY_SPAN / KEY_TILE][HEAD_DIM][KEY_TILE], so that a tile is contiguous
 * and does not alias in the L1 cache) and V [KEY_SPAN][HEAD_DIM], in fp32, for keys [k0, k1) of
 * one KV head (zeros past k1, up to the next whole tile). */
#define KT_INDEX(j, d) (((long)(j) / KEY_TILE * HEAD_DIM + (d)) * KEY_TILE + (j) % KEY_TILE)
INLINE void stage(const Args *a, const int32_t *table, int kv, int k0, int k1, float *kt,
                  float *vf, int bf16) {
    const long slot_len = (long)a->num_kv_heads * HEAD_DIM;
    const int padded = (k1 - k0 + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    for (int j = 0; j < padded; ++j) {
        float *vrow = vf + (long)j * HEAD_DIM;
        if (k0 + j >= k1) {
            for (int d = 0; d < HEAD_DIM; ++d) kt[KT_INDEX(j, d)] = 0.0f;
            memset(vrow, 0, sizeof(float) * HEAD_DIM);
            continue;
        }
        const int t = k0 + j;
        const long slot = (long)table[t / a->block_size] * a->block_size + t % a->block_size;
        const long base = slot * slot_len + (long)kv * HEAD_DIM;
        for (int d = 0; d < HEAD_DIM; ++d) kt[KT_INDEX(j, d)] = load(a->k_cache, base + d, bf16);
        for (int d = 0; d < HEAD_DIM; ++d) vrow[d] = load(a->v_cache, base + d, bf16);
    }
}

/* The online softmax of a tile's scores for ROW_BLOCK rows: masks keys past each row's
 * position (or past k1), updates the running max m and sum l, and leaves the tile's weights in
 * p and, per row, the factor its earlier output must be scaled by. */
INLINE void softmax_tile(vec s[ROW_BLOCK][TV], const int *pos, int first, int t0, int k1,
                         float *m, float *l, float *correction, float p[ROW_BLOCK][KEY_TILE]) {
    veci lane;
    for (int i = 0; i < VL; ++i) lane[i] = i;
    const int masked = t0 + KEY_TILE - 1 > first || t0 + KEY_TILE > k1;
    for (int r = 0; r < ROW_BLOCK; ++r) {
        if (masked) {
            const int bound = pos[r] < k1 - 1 ? pos[r] : k1 - 1;
            for (int c = 0; c < TV; ++c)
                s[r][c] = vselect(lane + (t0 + VL * c) > bound, splat(MASKED), s[r][c]);
        }
        vec top = s[r][0];
        for (int c = 1; c < TV; ++c) top = vselect(s[r][c] > top, s[r][c], top);
        const float tile_max = hmax(top);
        correction[r] = 1.0f;
        if (tile_max > m[r]) {
            correction[r] = expf(m[r] - tile_max);
            m[r] = tile_max;
        }
        vec sum = splat(0.0f);
        for (int c = 0; c < TV; ++c) {
            const vec e = vexp(s[r][c] - m[r]);
            vstore(p[r] + VL * c, e);
            sum += e;
        }
        l[r] = l[r] * correction[r] + hsum(sum);
    }
}

/* The first and last key positions of a block of rows: keys up to `first` are visible to all
 * of them, keys past `limit` to none. */
INLINE void row_bounds(const int *pos, int rows, int *first, int *limit) {
    *first = *limit = pos[0];
    for (int r = 1; r < rows; ++r) {
        *limit = pos[r] > *limit ? pos[r] : *limit;
        *first = pos[r] < *first ? pos[r] : *first;
    }
}

/* Rows [r0, r0 + ROW_BLOCK) of an item over the staged keys [k0, k1). A row's state: acc
 * (unnormalized output), running max m and sum l. Per key tile, the scores of all the block's
 * rows are computed with the tile's keys loaded once, then the rows' softmax weights are kept
 * in `p` while the values are accumulated, each value row loaded once: both loops are bound by
 * multiply-adds rather than loads. */
INLINE void attend_rows(const float *qf, const int *pos, float *acc, float *m, float *l,
                        const float *kt, const float *vf, int k0, int k1) {
    int first, limit;
    row_bounds(pos, ROW_BLOCK, &first, &limit);
    const int end = limit + 1 < k1 ? limit + 1 : k1;
    if (end <= k0) return;
    float p[ROW_BLOCK][KEY_TILE];
    for (int t0 = k0; t0 < end; t0 += KEY_TILE) {
        const int j0 = t0 - k0;
        vec s[ROW_BLOCK][TV];
        for (int r = 0; r < ROW_BLOCK; ++r)
            for (int c = 0; c < TV; ++c) s[r][c] = splat(0.0f);
        const float *ktile = kt + KT_INDEX(j0, 0);
        for (int d = 0; d < HEAD_DIM; ++d) {
            vec k[TV];
            for (int c = 0; c < TV; ++c) k[c] = vload(ktile + (long)d * KEY_TILE + VL * c);
            for (int r = 0; r < ROW_BLOCK; ++r) {
                const vec qv = splat(qf[(long)r * HEAD_DIM + d]);
                for (int c = 0; c < TV; ++c) s[r][c] += qv * k[c];
            }
        }
        float correction[ROW_BLOCK];
        softmax_tile(s, pos, first, t0, k1, m, l, correction, p);
        for (int d0 = 0; d0 < DV; d0 += DCHUNK) {
            float *out = acc + VL * d0;
            vec o[ROW_BLOCK][DCHUNK];
            for (int r = 0; r < ROW_BLOCK; ++r)
                for (int d = 0; d < DCHUNK; ++d)
                    o[r][d] = vload(out + (long)r * HEAD_DIM + VL * d) * correction[r];
            for (int j = 0; j < KEY_TILE; ++j) {
                const float *v = vf + (long)(j0 + j) * HEAD_DIM + VL * d0;
                vec vv[DCHUNK];
                for (int d = 0; d < DCHUNK; ++d) vv[d] = vload(v + VL * d);
                for (int r = 0; r < ROW_BLOCK; ++r) {
                    const vec w = splat(p[r][j]);
                    for (int d = 0; d < DCHUNK; ++d) o[r][d] += w * vv[d];
                }
            }
            for (int r = 0; r < ROW_BLOCK; ++r)
                for (int d = 0; d < DCHUNK; ++d)
                    vstore(out + (long)r * HEAD_DIM + VL * d, o[r][d]);
        }
    }
}

#ifdef __AVX512BF16__
/* bf16 with AVX-512 bf16: scores and weighted values as bf16 dot products of pairs
 * (vdpbf16ps: two multiply-adds a lane), half the instructions of the fp32 path. K is staged
 * as pairs of dimensions, [tile][HEAD_DIM / 2][KEY_TILE] 32-bit words, V as pairs of keys,
 * [KEY_SPAN / 2][HEAD_DIM] words; the weights are rounded to bf16 before they weigh V. */
#define PAIRS 1
#define KP_INDEX(j, p) (((long)(j) / KEY_TILE * (HEAD_DIM / 2) + (p)) * KEY_TILE + (j) % KEY_TILE)

INLINE void stage_pairs(const Args *a, const int32_t *table, int kv, int k0, int k1,
                        uint32_t *kp, uint32_t *vp) {
    const long slot_len = (long)a->num_kv_heads * HEAD_DIM;
    const int padded = (k1 - k0 + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    const uint16_t *kc = a->k_cache, *vc = a->v_cache;
    for (int j = 0; j < padded; ++j) {
        const int t = k0 + j;
        uint16_t *vwords = (uint16_t *)(vp + (long)(j / 2) * HEAD_DIM) + j % 2;
        if (t >= k1) {
            for (int p = 0; p < HEAD_DIM / 2; ++p) kp[KP_INDEX(j, p)] = 0;
            for (int d = 0; d < HEAD_DIM; ++d) vwords[2 * d] = 0;
            continue;
        }
        const long slot = (long)table[t / a->block_size] * a->block_size + t % a->block_size;
        const long base = slot * slot_len + (long)kv * HEAD_DIM;
        uint32_t words[HEAD_DIM / 2];
        memcpy(words, kc + base, sizeof words);
        for (int p = 0; p < HEAD_DIM / 2; ++p) kp[KP_INDEX(j, p)] = words[p];
        for (int d = 0; d < HEAD_DIM; ++d) vwords[2 * d] = vc[base + d];
    }
}

INLINE vec dot_pairs(vec acc, const uint32_t *pairs, uint32_t broadcast) {
    __m512i x;
    memcpy(&x, pairs, sizeof x);
    return (vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)_mm512_set1_epi32((int)broadcast));
}

INLINE void attend_rows_pairs(const uint32_t *qp, const int *pos, float *acc, float *m, float *l,
                              const uint32_t *kp, const uint32_t *vp, int k0, int k1,
                              float scale) {
    int first, limit;
    row_bounds(pos, ROW_BLOCK, &first, &limit);
    const int end = limit + 1 < k1 ? limit + 1 : k1;
    if (end <= k0) return;
    float p[ROW_BLOCK][KEY_TILE];
    uint32_t w[ROW_BLOCK][KEY_TILE / 2];
    for (int t0 = k0; t0 < end; t0 += KEY_TILE) {
        const int j0 = t0 - k0;
        vec s[ROW_BLOCK][TV];
        for (int r = 0; r < ROW_BLOCK; ++r)
            for (int c = 0; c < TV; ++c) s[r][c] = splat(0.0f);
        const uint32_t *ktile = kp + KP_INDEX(j0, 0);
        for (int d = 0; d < HEAD_DIM / 2; ++d)
            for (int r = 0; r < ROW_BLOCK; ++r)
                for (int c = 0; c < TV; ++c)
                    s[r][c] = dot_pairs(s[r][c], ktile + (long)d * KEY_TILE + VL * c,
                                        qp[(long)r * (HEAD_DIM / 2) + d]);
        for (int r = 0; r < ROW_BLOCK; ++r)
            for (int c = 0; c < TV; ++c) s[r][c] *= scale;
        float correction[ROW_BLOCK];
        softmax_tile(s, pos, first, t0, k1, m, l, correction, p);
        for (int r = 0; r < ROW_BLOCK; ++r)
            for (int c = 0; c < TV; c += 2) {
                const __m512bh h = _mm512_cvtne2ps_pbh((__m512)vload(p[r] + VL * c + VL),
                                                       (__m512)vload(p[r] + VL * c));
                memcpy(w[r] + 8 * c, &h, sizeof h);
            }
        vec o[ROW_BLOCK][DV];
        for (int r = 0; r < ROW_BLOCK; ++r)
            for (int d = 0; d < DV; ++d)
                o[r][d] = vload(acc + (long)r * HEAD_DIM + VL * d) * correction[r];
        for (int j = 0; j < KEY_TILE / 2; ++j) {
            const uint32_t *v = vp + (long)(j0 / 2 + j) * HEAD_DIM;
            for (int r = 0; r < ROW_BLOCK; ++r)
                for (int d = 0; d < DV; ++d) o[r][d] = dot_pairs(o[r][d], v + VL * d, w[r][j]);
        }
        for (int r = 0; r < ROW_BLOCK; ++r)
            for (int d = 0; d < DV; ++d) vstore(acc + (long)r * HEAD_DIM + VL * d, o[r][d]);
    }
}
#else
#define PAIRS 0
#endif

#if PAIRS && defined(__AMX_TILE__) && defined(__AMX_BF16__) && KEY_TILE == 64 && HEAD_DIM % 64 == 0
/* bf16 on AMX tiles, 16 rows at a time: a key tile's scores as 16 x 16 fp32 tiles of Q (16
 * rows x 32 dimensions) times K (16 pairs of dimensions x 16 keys: the staged pairs, read with
 * a row stride), its weighted values as tiles of P (16 rows x 32 keys) times V (16 pairs of
 * keys x 16 dimensions: the staged key pairs). The softmax runs on the scores stored from the
 * tiles; a key tile's weighted values come out of fresh tiles and are added to the rescaled
 * output in memory. Tiles 0-3 accumulate, 4 holds the A operand and 6 the B operand. */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#define AMX_ROWS 16

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux lends a process the tiles' state only once asked; before that the first tile
 * instruction faults. Asked once (a race asks twice, harmlessly); refused, the vector path
 * runs. */
static int amx_permitted(void) {
    static int state = -1;
    if (state < 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                        18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
}

/* Every tile 16 rows of 64 bytes (16 fp32 or 32 bf16); per thread, before its first use. */
INLINE void amx_configure(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* exp(x) for x <= 0 to the precision of the bf16 weights it becomes (relative error below
 * 1e-5): 2^n * p(r) with n = round(x / ln2), r in [-ln2/2, ln2/2], p of degree 5; about
 * 1.6e-38 at and below -87 (a masked score's weight: nothing beside any unmasked one). */
INLINE __m512 exp_for_bf16(__m512 x) {
    const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), clamped);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 120.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One row's online softmax over a key tile of stored scores: its weights as bf16 in w. */
INLINE void softmax_row(const float *scores, int pos, int t0, int k1, float scale, float *m,
                        float *l, float *correction, uint16_t *w) {
    const int bound = pos < k1 - 1 ? pos : k1 - 1;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512 x[TV];
    __m512 top = _mm512_set1_ps(MASKED);
    for (int c = 0; c < TV; ++c) {
        x[c] = _mm512_mul_ps(_mm512_load_ps(scores + VL * c), scale_v);
        if (t0 + KEY_TILE - 1 > bound) {
            const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(t0 + VL * c));
            const __mmask16 hidden = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(bound));
            x[c] = _mm512_mask_mov_ps(x[c], hidden, _mm512_set1_ps(MASKED));
        }
        top = _mm512_max_ps(top, x[c]);
    }
    const float tile_max = _mm512_reduce_max_ps(top);
    *correction = 1.0f;
    if (tile_max > *m) {
        *correction = expf(*m - tile_max);
        *m = tile_max;
    }
    const __m512 max_v = _mm512_set1_ps(*m);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < TV; c += 2) {
        const __m512 low = exp_for_bf16(_mm512_sub_ps(x[c], max_v));
        const __m512 high = exp_for_bf16(_mm512_sub_ps(x[c + 1], max_v));
        sum = _mm512_add_ps(sum, _mm512_add_ps(low, high));
        const __m512bh h = _mm512_cvtne2ps_pbh(high, low);
        memcpy(w + VL * c, &h, sizeof h);
    }
    *l = *l * *correction + _mm512_reduce_add_ps(sum);
}

/* Transposes 16 rows of 16 words in place. */
INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* stage_pairs' layouts, 16 keys at a time: K's pairs of dimensions by 16 x 16 transposes of
 * words, V's pairs of keys by interleaving two keys' rows, where stage_pairs moves a word at a
 * time (on AMX it took about a fifth of a long prompt's attention). */
INLINE void stage_pairs_amx(const Args *a, const int32_t *table, int kv, int k0, int k1,
                            uint32_t *kp, uint32_t *vp) {
    const long slot_len = (long)a->num_kv_heads * HEAD_DIM;
    const int padded = (k1 - k0 + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    const uint16_t *kc = a->k_cache, *vc = a->v_cache;
    __m512i first_dims, last_dims; /* a's and b's 16-bit lanes interleaved: a0 b0 a1 b1 ... */
    int16_t lanes[2][32];
    for (int i = 0; i < 16; ++i) {
        lanes[0][2 * i] = (int16_t)i;
        lanes[0][2 * i + 1] = (int16_t)(32 + i);
        lanes[1][2 * i] = (int16_t)(16 + i);
        lanes[1][2 * i + 1] = (int16_t)(48 + i);
    }
    memcpy(&first_dims, lanes[0], sizeof first_dims);
    memcpy(&last_dims, lanes[1], sizeof last_dims);
    for (int j = 0; j < padded; j += 16) {
        long base[16];
        for (int i = 0; i < 16; ++i) {
            const int t = k0 + j + i;
            base[i] = -1; /* past the context: zeros */
            if (t < k1) {
                const long slot = (long)table[t / a->block_size] * a->block_size
                                  + t % a->block_size;
                base[i] = slot * slot_len + (long)kv * HEAD_DIM;
            }
        }
        for (int b = 0; b < HEAD_DIM / 32; ++b) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = base[i] < 0 ? _mm512_setzero_si512()
                                   : _mm512_loadu_si512(kc + base[i] + 32 * b);
            transpose16(r);
            for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kp + KP_INDEX(j, 16 * b + p), r[p]);
        }
        for (int i = 0; i < 16; i += 2)
            for (int d = 0; d < HEAD_DIM; d += 32) {
                const __m512i even = base[i] < 0 ? _mm512_setzero_si512()
                                                 : _mm512_loadu_si512(vc + base[i] + d);
                const __m512i odd = base[i + 1] < 0 ? _mm512_setzero_si512()
                                                    : _mm512_loadu_si512(vc + base[i + 1] + d);
                uint32_t *out = vp + (long)((j + i) / 2) * HEAD_DIM + d;
                _mm512_storeu_si512(out, _mm512_permutex2var_epi16(even, first_dims, odd));
                _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi16(even, last_dims, odd));
            }
    }
}

#define SCORES(C)                                                                         \
    _tile_loadd(6, ktile + (long)(16 * half) * KEY_TILE + 16 * (C), KEY_TILE * 4);       \
    _tile_dpbf16ps(C, 4, 6)
#define WEIGH(C)                                                                          \
    _tile_loadd(6, vp + (long)(j0 / 2 + 16 * half) * HEAD_DIM + 16 * (group + (C)),     \
                HEAD_DIM * 4);                                                            \
    _tile_dpbf16ps(C, 4, 6)
#define STORE(C, base, stride) _tile_stored(C, (base) + 16 * (C), stride)

INLINE void attend_rows_amx(const uint32_t *qp, const int *pos, float *acc, float *m, float *l,
                            const uint32_t *kp, const uint32_t *vp, int k0, int k1,
                            float scale) {
    int first, limit;
    row_bounds(pos, AMX_ROWS, &first, &limit);
    const int end = limit + 1 < k1 ? limit + 1 : k1;
    if (end <= k0) return;
    float scores[AMX_ROWS][KEY_TILE] __attribute__((aligned(64)));
    uint16_t weights[AMX_ROWS][KEY_TILE] __attribute__((aligned(64)));
    float values[AMX_ROWS][HEAD_DIM] __attribute__((aligned(64)));
    float correction[AMX_ROWS];
    for (int t0 = k0; t0 < end; t0 += KEY_TILE) {
        const int j0 = t0 - k0;
        const uint32_t *ktile = kp + KP_INDEX(j0, 0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int half = 0; half < HEAD_DIM / 32; ++half) {
            _tile_loadd(4, qp + 16 * half, HEAD_DIM / 2 * 4);
            SCORES(0);
            SCORES(1);
            SCORES(2);
            SCORES(3);
        }
        STORE(0, scores[0], KEY_TILE * 4);
        STORE(1, scores[0], KEY_TILE * 4);
        STORE(2, scores[0], KEY_TILE * 4);
        STORE(3, scores[0], KEY_TILE * 4);
        for (int r = 0; r < AMX_ROWS; ++r)
            softmax_row(scores[r], pos[r], t0, k1, scale, m + r, l + r, correction + r,
                        weights[r]);
        for (int group = 0; group < HEAD_DIM / 16; group += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int half = 0; half < KEY_TILE / 32; ++half) {
                _tile_loadd(4, weights[0] + 32 * half, KEY_TILE * 2);
                WEIGH(0);
                WEIGH(1);
                WEIGH(2);
                WEIGH(3);
            }
            STORE(0, values[0] + 16 * group, HEAD_DIM * 4);
            STORE(1, values[0] + 16 * group, HEAD_DIM * 4);
            STORE(2, values[0] + 16 * group, HEAD_DIM * 4);
            STORE(3, values[0] + 16 * group, HEAD_DIM * 4);
        }
        for (int r = 0; r < AMX_ROWS; ++r)
            for (int d = 0; d < DV; ++d) {
                float *out = acc + (long)r * HEAD_DIM + VL * d;
                vstore(out, vload(out) * correction[r] + vload(values[r] + VL * d));
            }
    }
}
#else
#define AMX 0
#endif

/* Query tokens per work item. On AMX tiles twice as many: an item stages its keys and values
 * for every span of its context, and there that staging weighs more beside the compute. */
static int query_chunk(int bf16) {
#if AMX
    if (bf16 && amx_permitted()) return 2 * QUERY_CHUNK;
#endif
    (void)bf16;
    return QUERY_CHUNK;
}

/* One item: sequence `seq`'s query tokens [c0, c1) for KV head kv. Returns 1 when out of
 * memory. */
INLINE int attend_item(const Args *a, const int32_t *query_starts, const int32_t *cached_lens,
                       int seq, int kv, int c0, int c1, int bf16) {
    const int cached = cached_lens[seq];
    const int tokens = c1 - c0;
    const int rows = tokens * GROUP;
#if AMX
    const int amx = bf16 && amx_permitted();
    const int block = amx ? AMX_ROWS : ROW_BLOCK;
#else
    const int block = ROW_BLOCK;
#endif
    const int padded_rows = (rows + block - 1) / block * block;
    const size_t floats = (size_t)padded_rows * (2 * HEAD_DIM + 2)
                          + (size_t)2 * KEY_SPAN * HEAD_DIM;
    float *qf = malloc(sizeof(float) * floats + sizeof(int) * (size_t)padded_rows);
    if (qf == NULL) return 1;
    float *acc = qf + (size_t)padded_rows * HEAD_DIM;
    float *m = acc + (size_t)padded_rows * HEAD_DIM;
    float *l = m + padded_rows;
    float *kt = l + padded_rows;
    float *vf = kt + (size_t)KEY_SPAN * HEAD_DIM;
    int *pos = (int *)(vf + (size_t)KEY_SPAN * HEAD_DIM);
    const int32_t *table = a->block_tables + (long)seq * a->max_blocks;

    for (int r = 0; r < padded_rows; ++r) {
        /* padding rows repeat the last row (their results are not stored) */
        const int row = r < rows ? r : rows - 1;
        const int t = c0 + row / GROUP, h = kv * GROUP + row % GROUP;
        const long q_offset = (long)(query_starts[seq] + t) * a->q_stride + (long)h * HEAD_DIM;
        if (PAIRS && bf16)
            memcpy((uint32_t *)qf + (long)r * (HEAD_DIM / 2), (const uint16_t *)a->q + q_offset,
                   sizeof(uint16_t) * HEAD_DIM);
        else
            for (int d = 0; d < HEAD_DIM; ++d)
                qf[(long)r * HEAD_DIM + d] = load(a->q, q_offset + d, bf16) * a->scale;
        pos[r] = cached + t;
        m[r] = MASKED;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)padded_rows * HEAD_DIM);
    const int keys = cached + c1;
    for (int k0 = 0; k0 < keys; k0 += KEY_SPAN) {
        const int k1 = k0 + KEY_SPAN < keys ? k0 + KEY_SPAN : keys;
#if PAIRS
        if (bf16) {
            /* the raw bf16 pairs of q; the scale is applied to the scores */
            uint32_t *qp = (uint32_t *)qf, *kp = (uint32_t *)kt, *vp = (uint32_t *)vf;
#if AMX
            if (amx) {
                stage_pairs_amx(a, table, kv, k0, k1, kp, vp);
                if (k0 == 0) amx_configure();
                for (int r = 0; r < padded_rows; r += AMX_ROWS)
                    attend_rows_amx(qp + (long)r * (HEAD_DIM / 2), pos + r,
                                    acc + (long)r * HEAD_DIM, m + r, l + r, kp, vp, k0, k1,
                                    a->scale);
                if (k1 == keys) _tile_release();
                continue;
            }
#endif
            stage_pairs(a, table, kv, k0, k1, kp, vp);
            for (int r = 0; r < padded_rows; r += ROW_BLOCK)
                attend_rows_pairs(qp + (long)r * (HEAD_DIM / 2), pos + r,
                                  acc + (long)r * HEAD_DIM, m + r, l + r, kp, vp, k0, k1, a->scale);
            continue;
        }
#endif
        stage(a, table, kv, k0, k1, kt, vf, bf16);
        for (int r = 0; r < padded_rows; r += ROW_BLOCK)
            attend_rows(qf + (long)r * HEAD_DIM, pos + r, acc + (long)r * HEAD_DIM, m + r, l + r,
                        kt, vf, k0, k1);
    }
    for (int r = 0; r < rows; ++r) {
        const int t = c0 + r / GROUP, h = kv * GROUP + r % GROUP;
        const long o_offset = ((long)(query_starts[seq] + t) * a->num_heads + h) * HEAD_DIM;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < HEAD_DIM; ++d)
            store(a->out, o_offset + d, acc[(long)r * HEAD_DIM + d] * inv, bf16);
    }
    free(qf);
    return 0;
}

/* q: [tokens, num_heads, HEAD_DIM] with rows q_stride elements apart, out: the same, contiguous
 * (sequence s's query rows start at query_starts[s]);
 * caches: [slots, num_kv_heads, HEAD_DIM]; block_tables: [num_seqs, max_blocks]; per sequence
 * its query_lens and cached_lens. Returns 0 on success, 1 when out of memory, 2 when the shape
 * does not match the compiled one. */
#define DEFINE_PREFILL_ATTENTION(NAME, BF16)                                                      \
    int NAME(const void *q, const void *k_cache, const void *v_cache,                             \
             const int32_t *block_tables, const int32_t *query_starts,                            \
             const int32_t *query_lens, const int32_t *cached_lens, void *out, long q_stride,     \
             int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,       \
             float scale, int num_threads) {                                                      \
        if (head_dim != HEAD_DIM || num_heads != num_kv_heads * GROUP) return 2;                  \
        const Args a = {q, k_cache, v_cache, out, block_tables, q_stride, max_blocks, num_heads,  \
                        num_kv_heads, block_size, scale};                                         \
        const int chunk_len = query_chunk(BF16);                                                  \
        long items = 0;                                                                           \
        for (int s = 0; s < num_seqs; ++s)                                                        \
            items += (long)(query_lens[s] + chunk_len - 1) / chunk_len * num_kv_heads;            \
        int failed = 0;                                                                           \
        _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")                 \
        for (long item = 0; item < items; ++item) {                                               \
            /* items run longest first: a sequence's later chunks see more keys */               \
            long left = items - 1 - item;                                                         \
            int s = 0;                                                                            \
            for (; s < num_seqs; ++s) {                                                           \
                const long here = (long)(query_lens[s] + chunk_len - 1) / chunk_len              \
                                  * num_kv_heads;                                                 \
                if (left < here) break;                                                           \
                left -= here;                                                                     \
            }                                                                                     \
            const int chunk = (int)(left / num_kv_heads), kv = (int)(left % num_kv_heads);        \
            const int c0 = chunk * chunk_len;                                                     \
            const int c1 = c0 + chunk_len < query_lens[s] ? c0 + chunk_len : query_lens[s];      \
            if (attend_item(&a, query_starts, cached_lens, s, kv, c0, c1, BF16)) failed = 1;      \
        }                                                                                         \
        return failed;                                                                            \
    }

/* 1 where bf16 runs on AMX tiles: compiled for a CPU with AMX, and the OS lends the tiles. */
int prefill_attention_bf16_on_amx(void) {
#if AMX
    return amx_permitted();
#else
    return 0;
#endif
}

DEFINE_PREFILL_ATTENTION(prefill_attention_bf16, 1)
DEFINE_PREFILL_ATTENTION(prefill_attention_f32, 0)
