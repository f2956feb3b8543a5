/* Extend (prefill) attention on CPU for a ragged batch, causal, reading every key and value by slot
 * straight from the paged pool: no gathered copy, no padded mask.
 *
 * Legend: B requests, T new tokens (all requests), Hq query heads, Hkv KV heads, G = Hq / Hkv,
 * Dk key (and query) width, Dv value width, L kv_slots' width, N pool slots (pages * page size S),
 * ext[b] request b's new tokens (its rows of q and out, in batch order), prefix[b] its cached keys,
 * W a tile's rows rounded up to whole vectors of V lanes.
 *
 * New token i of request b (position prefix + i) sees its request's first prefix + i + 1 keys; the
 * pool already holds this step's rows (the backend writes them before attention runs). Slot s is
 * row (s % S) of page s / S, as in decode_attention_cpu.c.
 *
 * Why not SDPA: at head dim 32-128 and requests of a few hundred tokens its blocking is far too
 * coarse (~28 GFLOPS on tiny-llama's prefill), and with a prefix every request's pages had to be
 * gathered first. Here a unit is (request, KV head, up to GROUP tiles of TILE query positions): the
 * G x TILE query rows of a tile share each block of BLOCK key and value rows while they sit in L1.
 * The rows lie across a vector's lanes ("transposed": the tile's queries qt [Dk, W], its output
 * accumulator acc [Dv, W], the block's scores [BLOCK, W]), so
 * - a block's scores are a small GEMM: a key element, read straight from its pool row, broadcast
 *   against a vector of 16 rows' query elements, 8 keys x 2 row vectors in registers at once;
 * - online softmax is lane-wise for 16 rows at a time (running max m and sum l per lane): no
 *   horizontal max or sum, one exp per block for the rescale, no transposed copy of the keys;
 * - the values likewise: a value element broadcast against 16 rows' probabilities, 8 columns x 2 row
 *   vectors in registers.
 * The queries are scaled by scale * log2(e) once per tile, so the softmax takes powers of 2. Keys
 * after a row's position (the diagonal block) are skipped by a lane mask. Units run on the helper
 * threads of cpu_threads.h; each is computed whole by one thread in a fixed order, so the result is
 * the same bits for any thread count.
 *
 * Built by pdserve_kernels/extend_attention_cpu.py with the system compiler; plain C99 plus GCC/Clang
 * vector extensions (no torch headers); with AVX-512 the softmax's max and power of 2 use its
 * instructions, elsewhere a portable twin.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_attention.h"
#include "cpu_threads.h"

enum { OK = 0, BAD_SLOT = 1, BAD_PREFIX = 2, NO_MEMORY = 3, BAD_EXT = 4, BAD_TOTAL = 5 };

#ifndef BLOCK
#define BLOCK 64 /* keys per softmax block (a multiple of KEYS): a block's K and V rows stay in L1 */
#endif
#ifndef TILE
#define TILE 16 /* query positions per tile: G x TILE rows of scores, BLOCK wide */
#endif
#ifndef GROUP
#define GROUP 4 /* tiles per unit: a key block's slots are resolved once for them, its rows stay in L1 */
#endif

#define V 16   /* lanes of a v16f */
#define KEYS 8 /* keys (score rows) and value columns per register block */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
_Static_assert(BLOCK % KEYS == 0, "a block's key rows are filled up to a multiple of KEYS (block_rows)");

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int64_t *kv_slots, *prefix, *ext, *q_start, *group_req, *group_row;
    int64_t S, k_page, k_head, k_token, v_page, v_head, v_token, Hq, Hkv, G, Dk, Dv, slot_stride;
    float scale;
    int shift; /* log2(S) where S is a power of two, else -1 */
} job_t;

/* Key and value rows of KV head h for slots sl[0..nb); keys up to the next multiple of KEYS: the first
 * row again (their scores are computed with the block's, then masked) */
static void block_rows(const job_t *jb, const int64_t *sl, int64_t nb, int64_t h, const float **kr, const float **vr) {
    for (int64_t j = 0; j < nb; j++) {
        int64_t page, off;
        slot_page(sl[j], jb->shift, jb->S, &page, &off);
        kr[j] = jb->k + page * jb->k_page + h * jb->k_head + off * jb->k_token;
        vr[j] = jb->v + page * jb->v_page + h * jb->v_head + off * jb->v_token;
    }
    for (int64_t j = nb; j % KEYS; j++) kr[j] = kr[0];
}

static inline v16f vload(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void vstore(float *p, v16f x) { memcpy(p, &x, sizeof x); }

static inline v16f vmax(v16f a, v16f b) {
#ifdef __AVX512F__
    return (v16f)_mm512_max_ps((__m512)a, (__m512)b);
#else
    v16i keep = a > b;
    return (v16f)(((v16i)a & keep) | ((v16i)b & ~keep));
#endif
}

/* 2^x for 16 lanes of x <= 0 (scores minus their running max, in log2 units), relative error about
 * 1e-7: x = n + f with n an integer, |f| <= 1/2, 2^f by its degree-6 series in f ln 2, times 2^n.
 * Lanes below -125 (nothing beside the max's 1) give about 2^-125. */
static inline v16f vexp2(v16f x) {
    const v16f zero = {0};
    x = vmax(x, zero - 125.0f);
#ifdef __AVX512F__
    v16f n = (v16f)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const v16f magic = zero + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v16f r = x + magic, n = r - magic;
#endif
    v16f f = x - n;
    v16f p = 1.0f + f * (0.693147180559945309f + f * (0.240226506959100712f + f * (0.0555041086648215800f +
             f * (0.00961812910762847717f + f * (0.00133335581464284434f + f * 0.000154035303933816099f)))));
#ifdef __AVX512F__
    return (v16f)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    return (v16f)((v16u)p + (((v16u)r - 0x4B400000u) << 23));
#endif
}

/* x[k][c] <- x[c][k]: the off-diagonal blocks of 8, 4, 2 and 1 swapped in turn, 64 two-vector shuffles
 * for 256 floats (a scalar copy costs a load and a store each) */
#define SWAP_BLOCKS(b, ...) /* rows i and i + b where i & b == 0: lo keeps i's own block, takes i + b's */ \
    for (int i = 0; i < V; i++)                                                                            \
        if (!(i & b)) {                                                                                    \
            const v16f lo = __builtin_shufflevector(x[i], x[i + b], __VA_ARGS__);                          \
            x[i + b] = __builtin_shufflevector(x[i], x[i + b], HI_##b);                                    \
            x[i] = lo;                                                                                     \
        }
#define HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
ALWAYS_INLINE void transpose16(v16f x[V]) {
    SWAP_BLOCKS(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
    SWAP_BLOCKS(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
    SWAP_BLOCKS(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
    SWAP_BLOCKS(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
}

/* s[k][c] = sum_d kr[k][d] qt[d][c] for KEYS keys and nr (1 or 2) row vectors: rows of s and qt W apart */
ALWAYS_INLINE void scores_block(const float *qt, int64_t W, const float *const *kr, int64_t Dk, float *s, const int nr) {
    v16f a[KEYS][2] = {{{0}}};
    for (int64_t d = 0; d < Dk; d++) {
        const v16f q0 = vload(qt + d * W), q1 = nr > 1 ? vload(qt + d * W + V) : q0;
        for (int k = 0; k < KEYS; k++) {
            const float x = kr[k][d];
            a[k][0] += x * q0;
            if (nr > 1) a[k][1] += x * q1;
        }
    }
    for (int k = 0; k < KEYS; k++)
        for (int c = 0; c < nr; c++) vstore(s + k * W + c * V, a[k][c]);
}

/* acc[d0 + x][c] += sum_j vr[j][d0 + x] p[j][c] for x < nd columns, nr (1 or 2) row vectors, nb keys */
ALWAYS_INLINE void values_block(const float *const *vr, int64_t nb, const float *p, int64_t W, float *acc, int64_t d0,
                                const int nd, const int nr) {
    v16f a[KEYS][2];
    for (int x = 0; x < nd; x++)
        for (int c = 0; c < nr; c++) a[x][c] = vload(acc + (d0 + x) * W + c * V);
    for (int64_t j = 0; j < nb; j++) {
        const v16f p0 = vload(p + j * W), p1 = nr > 1 ? vload(p + j * W + V) : p0;
        const float *row = vr[j] + d0;
        for (int x = 0; x < nd; x++) {
            a[x][0] += row[x] * p0;
            if (nr > 1) a[x][1] += row[x] * p1;
        }
    }
    for (int x = 0; x < nd; x++)
        for (int c = 0; c < nr; c++) vstore(acc + (d0 + x) * W + c * V, a[x][c]);
}

/* All Dv columns of the values for row vectors [c, c + nr): KEYS at a time, then 4, 2, 1 */
ALWAYS_INLINE void values_cols(const float *const *vr, int64_t nb, const float *p, int64_t W, float *acc, int64_t Dv,
                               const int nr) {
    int64_t d0 = 0;
    for (; d0 + KEYS <= Dv; d0 += KEYS) values_block(vr, nb, p, W, acc, d0, KEYS, nr);
    if (d0 + 4 <= Dv) values_block(vr, nb, p, W, acc, d0, 4, nr), d0 += 4;
    if (d0 + 2 <= Dv) values_block(vr, nb, p, W, acc, d0, 2, nr), d0 += 2;
    if (d0 < Dv) values_block(vr, nb, p, W, acc, d0, 1, nr);
}

/* Tile of a unit: R = G x nq query rows (lane r = i * G + g: position i0 + i, query head h * G + g),
 * in W lanes; its first nk keys (prefix + i0 + nq). last[r]: the last key lane r sees (padding lanes:
 * the last row's, over zero queries, so every lane's softmax stays finite). Scratch (floats) per
 * tile: qt [Dk, W], acc [Dv, W], m, l and last [W], cap (W's bound) lanes each. */
typedef struct {
    int64_t i0, nq, R, W, nk;
    float *qt, *acc, *m, *l;
    int32_t *last;
} tile_t;

/* at[k]: where lane r0 + k's row starts (position i = r / G, head g = r % G: i stride + g D), -1 past R.
 * One division per 16 lanes, then counters, not two 64-bit divisions per lane */
static void lane_rows(int64_t stride, int64_t D, int64_t G, int64_t r0, int64_t R, int64_t *at) {
    int64_t i = r0 / G, g = r0 % G;
    for (int k = 0; k < V; k++) {
        at[k] = r0 + k < R ? i * stride + g * D : -1;
        if (++g == G) g = 0, i++;
    }
}

static void tile_start(const job_t *jb, int64_t b, int64_t h, int64_t i0, float *mem, int64_t cap, tile_t *t) {
    const int64_t G = jb->G, Dk = jb->Dk, Dv = jb->Dv, Hq = jb->Hq;
    t->i0 = i0, t->nq = jb->ext[b] - i0 < TILE ? jb->ext[b] - i0 : TILE;
    t->R = t->nq * G, t->W = (t->R + V - 1) / V * V, t->nk = jb->prefix[b] + i0 + t->nq;
    t->qt = mem, t->acc = mem + cap * Dk, t->m = t->acc + cap * Dv, t->l = t->m + cap, t->last = (int32_t *)(t->l + cap);
    const float *q0 = jb->q + ((jb->q_start[b] + i0) * Hq + h * G) * Dk;
    const float c = jb->scale * 1.44269504088896341f; /* log2(e): the softmax takes powers of 2 */
    for (int64_t r = 0, i = 0, g = 0; r < t->W; r++) {
        t->m[r] = -INFINITY, t->l[r] = 0.0f;
        t->last[r] = (int32_t)(jb->prefix[b] + i0 + (i < t->nq ? i : t->nq - 1));
        if (++g == G) g = 0, i++;
    }
    for (int64_t r0 = 0; r0 < t->W; r0 += V) { /* 16 lanes at a time: blocks of 16 x 16 transposed, a scalar tail */
        int64_t at[V];
        lane_rows(Hq * Dk, Dk, G, r0, t->R, at);
        int64_t d = 0;
        for (; r0 + V <= t->R && d + V <= Dk; d += V) {
            v16f x[V];
            for (int k = 0; k < V; k++) x[k] = vload(q0 + at[k] + d);
            transpose16(x);
            for (int k = 0; k < V; k++) vstore(t->qt + (d + k) * t->W + r0, x[k] * c);
        }
        for (; d < Dk; d++)
            for (int k = 0; k < V; k++) t->qt[d * t->W + r0 + k] = at[k] >= 0 ? q0[at[k] + d] * c : 0.0f;
    }
    for (int64_t x = 0; x < Dv * t->W; x++) t->acc[x] = 0.0f;
}

/* Row vector c's scores s[0, nb) of the block at key j0 folded into its running max and sum, the
 * accumulator rescaled; s becomes 2^(score - max), 0 for the keys a lane does not see (masked only
 * where some lane stops inside the block) */
static void softmax_block(float *s, int64_t W, int64_t nb, int64_t j0, const tile_t *t, int64_t Dv, int64_t c) {
    const v16f neg = (v16f){0} - INFINITY;
    v16i last;
    memcpy(&last, t->last + c, sizeof last);
    const int masked = j0 + nb - 1 > t->last[0];
    v16f mx = vload(t->m + c), m0 = mx;
    for (int64_t j = 0; j < nb; j++) {
        v16f x = vload(s + j * W + c);
        if (masked) {
            v16i seen = (int32_t)(j0 + j) <= last;
            x = (v16f)(((v16i)x & seen) | ((v16i)neg & ~seen));
            vstore(s + j * W + c, x);
        }
        mx = vmax(mx, x);
    }
    const v16f a = vexp2(m0 - mx); /* a new max: the running sum and output shrink by 2^(old - new) */
    vstore(t->m + c, mx);
    for (int64_t d = 0; d < Dv; d++) vstore(t->acc + d * W + c, vload(t->acc + d * W + c) * a);
    v16f sum = {0};
    for (int64_t j = 0; j < nb; j++) {
        v16f e = vexp2(vload(s + j * W + c) - mx);
        if (masked) e = (v16f)((v16i)e & ((int32_t)(j0 + j) <= last));
        sum += e;
        vstore(s + j * W + c, e);
    }
    vstore(t->l + c, vload(t->l + c) * a + sum);
}

/* One key block [j0, j0 + nb) of a tile (nb within its nk; kr and vr valid up to nb rounded up to
 * KEYS): scores, each row vector's softmax, the values */
static void tile_block(const job_t *jb, const tile_t *t, int64_t j0, int64_t nb, const float *const *kr,
                       const float *const *vr, float *s) {
    const int64_t Dk = jb->Dk, Dv = jb->Dv, W = t->W;
    int64_t c = 0;
    for (; c + 2 * V <= W; c += 2 * V)
        for (int64_t j = 0; j < nb; j += KEYS) scores_block(t->qt + c, W, kr + j, Dk, s + j * W + c, 2);
    if (c < W)
        for (int64_t j = 0; j < nb; j += KEYS) scores_block(t->qt + c, W, kr + j, Dk, s + j * W + c, 1);
    for (c = 0; c < W; c += V) softmax_block(s, W, nb, j0, t, Dv, c);
    for (c = 0; c + 2 * V <= W; c += 2 * V) values_cols(vr, nb, s + c, W, t->acc + c, Dv, 2);
    if (c < W) values_cols(vr, nb, s + c, W, t->acc + c, Dv, 1);
}

/* The tile's rows of out: acc / l, transposed back to a row per (position, query head) as tile_start's qt */
static void tile_finish(const job_t *jb, int64_t b, int64_t h, const tile_t *t) {
    const int64_t G = jb->G, Dv = jb->Dv;
    float *o0 = jb->out + ((jb->q_start[b] + t->i0) * jb->Hq + h * G) * Dv;
    for (int64_t r0 = 0; r0 < t->R; r0 += V) {
        int64_t at[V];
        float a[V];
        lane_rows(jb->Hq * Dv, Dv, G, r0, t->R, at);
        for (int k = 0; k < V; k++) a[k] = r0 + k < t->R ? 1.0f / t->l[r0 + k] : 0.0f;
        int64_t d = 0;
        for (; r0 + V <= t->R && d + V <= Dv; d += V) {
            v16f x[V];
            for (int k = 0; k < V; k++) x[k] = vload(t->acc + (d + k) * t->W + r0);
            transpose16(x);
            for (int k = 0; k < V; k++) vstore(o0 + at[k] + d, x[k] * a[k]);
        }
        for (; d < Dv; d++)
            for (int k = 0; k < V; k++)
                if (at[k] >= 0) o0[at[k] + d] = t->acc[d * t->W + r0 + k] * a[k];
    }
}

/* Unit u: group u / Hkv (up to GROUP tiles of one request), KV head u % Hkv. Each key block's rows
 * are found once for the group's tiles that see it; each tile's operations are those it would run
 * alone, in the same order. Scratch (floats): s [BLOCK, cap], then GROUP tiles'. */
static void attend_group(const void *arg, int64_t u, void *scratch) {
    const job_t *jb = arg;
    const int64_t gi = u / jb->Hkv, h = u % jb->Hkv, b = jb->group_req[gi], i0 = jb->group_row[gi];
    const int64_t Dk = jb->Dk, Dv = jb->Dv, cap = (jb->G * TILE + V - 1) / V * V;
    float *s = scratch, *mem = s + cap * BLOCK;
    const int64_t *sl = jb->kv_slots + b * jb->slot_stride;
    const float *kr[BLOCK], *vr[BLOCK];
    tile_t tiles[GROUP];
    int64_t n = 0, nk = 0;
    for (; n < GROUP && i0 + n * TILE < jb->ext[b]; n++) {
        tile_start(jb, b, h, i0 + n * TILE, mem + n * cap * (Dk + Dv + 3), cap, &tiles[n]);
        nk = tiles[n].nk;
    }
    for (int64_t j0 = 0; j0 < nk; j0 += BLOCK) {
        const int64_t nb = nk - j0 < BLOCK ? nk - j0 : BLOCK;
        block_rows(jb, sl + j0, nb, h, kr, vr);
        for (int64_t x = 0; x < n; x++)
            if (tiles[x].nk > j0) tile_block(jb, &tiles[x], j0, tiles[x].nk - j0 < nb ? tiles[x].nk - j0 : nb, kr, vr, s);
    }
    for (int64_t x = 0; x < n; x++) tile_finish(jb, b, h, &tiles[x]);
}

/* Every length and every slot a request reads, checked before any read of the pool; the number of
 * tile groups, or a negative error code */
static int64_t check(const int64_t *prefix, const int64_t *ext, int64_t B, int64_t T, const int64_t *kv_slots,
                     int64_t L, int64_t slot_stride, int64_t N) {
    int64_t total = 0, groups = 0;
    for (int64_t b = 0; b < B; b++) {
        if (ext[b] < 1) return -BAD_EXT;
        if (prefix[b] < 0 || prefix[b] > L - ext[b]) return -BAD_PREFIX;
        total += ext[b], groups += (ext[b] + GROUP * TILE - 1) / (GROUP * TILE);
    }
    if (total != T) return -BAD_TOTAL;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *sl = kv_slots + b * slot_stride, n = prefix[b] + ext[b];
        for (int64_t j = 0; j < n; j++)
            if (sl[j] < 0 || sl[j] >= N) return -BAD_SLOT;
    }
    return groups;
}

/* q [T, Hq, Dk] and out [T, Hq, Dv] contiguous, request b's rows after the ext rows of those before
 * it; kv_slots [B, L] with row stride slot_stride; prefix and ext [B]. Each ext in [1, L], prefix in
 * [0, L - ext], the ext summing to T, every slot read in [0, N): checked first. threads > 1 (where
 * the call scores at least min_scores query-key pairs): helper threads take units beside the caller. */
int pdserve_extend_attention_f32(const float *q, int64_t T, int64_t Hq, int64_t Dk, const float *k, const float *v,
                                 int64_t N, int64_t S, int64_t Hkv, int64_t k_page, int64_t k_head, int64_t k_token,
                                 int64_t v_page, int64_t v_head, int64_t v_token, int64_t Dv, const int64_t *kv_slots,
                                 int64_t L, int64_t slot_stride, const int64_t *prefix, const int64_t *ext, int64_t B,
                                 double scale, float *out, int64_t threads, int64_t min_scores) {
    const int64_t groups = check(prefix, ext, B, T, kv_slots, L, slot_stride, N);
    if (groups < 0) return (int)-groups;
    const int64_t G = Hq / Hkv, cap = (G * TILE + V - 1) / V * V;
    const int64_t floats = cap * BLOCK + GROUP * cap * (Dk + Dv + 3);
    int64_t *index = malloc(sizeof(int64_t) * (size_t)(B + 2 * groups + 1));
    float *sc = malloc(sizeof(float) * (size_t)floats);
    if (index == NULL || sc == NULL) {
        free(index), free(sc);
        return NO_MEMORY;
    }
    int64_t *q_start = index, *group_req = q_start + B, *group_row = group_req + groups, n = 0, work = 0;
    for (int64_t b = 0, start = 0; b < B; start += ext[b], b++) {
        q_start[b] = start;
        work += ext[b] * (prefix[b] + (ext[b] + 1) / 2) * Hq;
        for (int64_t i0 = 0; i0 < ext[b]; i0 += GROUP * TILE) group_req[n] = b, group_row[n++] = i0;
    }
    job_t jb = {q, k, v, out, kv_slots, prefix, ext, q_start, group_req, group_row, S, k_page, k_head, k_token,
                v_page, v_head, v_token, Hq, Hkv, G, Dk, Dv, slot_stride, (float)scale, page_shift(S)};
    cpu_threads_run(attend_group, &jb, groups * Hkv, (int64_t)sizeof(float) * floats, sc,
                    work < min_scores ? 1 : threads);
    free(index), free(sc);
    return OK;
}
