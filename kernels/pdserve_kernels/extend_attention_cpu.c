/* Extend (prefill) attention on CPU for a ragged batch, causal, reading every key and value by slot
 * straight from the paged pool: no gathered copy, no padded mask.
 *
 * Legend: B requests, T new tokens (all requests), Hq query heads, Hkv KV heads, G = Hq / Hkv,
 * Dk key (and query) width, Dv value width, L kv_slots' width, N pool slots (pages * page size S),
 * ext[b] request b's new tokens (its rows of q and out, in batch order), prefix[b] its cached keys.
 *
 * New token i of request b (position prefix + i) sees its request's first prefix + i + 1 keys; the
 * pool already holds this step's rows (the backend writes them before attention runs). Slot s is
 * row (s % S) of page s / S, as in decode_attention_cpu.c.
 *
 * Why not SDPA: at head dim 32-128 and requests of a few hundred tokens its blocking is far too
 * coarse (~28 GFLOPS on tiny-llama's prefill), and with a prefix every request's pages had to be
 * gathered first. Here a unit is (request, KV head, tile of TILE query positions): the tile's
 * G x TILE query rows share each block of BLOCK key and value rows while they sit in L1. Per block:
 * each row's scores over the keys it sees (the diagonal block's later keys skipped, not masked),
 * one online-softmax rescale per row (running max m, sum l), then the values into the rows'
 * accumulators. Units run on the helper threads of cpu_threads.h; each is computed whole by one
 * thread in a fixed order, so the result is the same bits for any thread count.
 *
 * Built by pdserve_kernels/extend_attention_cpu.py with the system compiler; plain C99 plus GCC/Clang
 * vector extensions (no torch headers).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"
#include "cpu_threads.h"

enum { OK = 0, BAD_SLOT = 1, BAD_PREFIX = 2, NO_MEMORY = 3, BAD_EXT = 4, BAD_TOTAL = 5 };

#ifndef BLOCK
#define BLOCK 64 /* keys per softmax block: a block's K and V rows (head dim <= 128) stay in L1 */
#endif
#ifndef TILE
#define TILE 16 /* query positions per tile: G x TILE rows of scores, BLOCK wide */
#endif
#ifndef GROUP
#define GROUP 4 /* tiles per unit: a key block is gathered and transposed once for them */
#endif

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int64_t *kv_slots, *prefix, *ext, *q_start, *group_req, *group_row;
    int64_t S, k_page, k_head, k_token, v_page, v_head, v_token, Hq, Hkv, G, Dk, Dv, slot_stride;
    float scale;
    int shift; /* log2(S) where S is a power of two, else -1 */
} job_t;

/* Key and value rows of KV head h for slots sl[0..nb) */
static void block_rows(const job_t *jb, const int64_t *sl, int64_t nb, int64_t h, const float **kr, const float **vr) {
    for (int64_t j = 0; j < nb; j++) {
        int64_t page, off;
        slot_page(sl[j], jb->shift, jb->S, &page, &off);
        kr[j] = jb->k + page * jb->k_page + h * jb->k_head + off * jb->k_token;
        vr[j] = jb->v + page * jb->v_page + h * jb->v_head + off * jb->v_token;
    }
}

#define V 16 /* lanes of a v16f */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* kt [Dk, BLOCK]: the block's key rows transposed (columns past nb up to nv V zero), so a row's scores
 * are V keys per multiply-add: a query element broadcast against a vector of keys */
static void transpose_keys(const float *const *kr, int64_t nb, int64_t nv, int64_t Dk, float *kt) {
    for (int64_t d = 0; d < Dk; d++) {
        float *row = kt + d * BLOCK;
        for (int64_t j = 0; j < nb; j++) row[j] = kr[j][d];
        for (int64_t j = nb; j < nv * V; j++) row[j] = 0.0f;
    }
}

/* sc[r][0, nv V) = qt[r] . kt for four rows: 4 x nv accumulators, one pass over kt */
ALWAYS_INLINE void scores4(const float *qt, const float *kt, int64_t Dk, float *sc, const int nv) {
    v16f a[4][4] = {{{0}}};
    for (int64_t d = 0; d < Dk; d++) {
        v16f kv[4];
        for (int c = 0; c < nv; c++) memcpy(&kv[c], kt + d * BLOCK + c * V, sizeof(v16f));
        for (int r = 0; r < 4; r++) {
            const float x = qt[r * Dk + d];
            for (int c = 0; c < nv; c++) a[r][c] += x * kv[c];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < nv; c++) memcpy(sc + r * BLOCK + c * V, &a[r][c], sizeof(v16f));
}

/* acc[r][d0, d0 + nc V) += sum_j p[r][j] v_j[d0, ...) over nb value rows, four rows */
ALWAYS_INLINE void values4(const float *const *vr, int64_t nb, const float *p, float *acc, int64_t Dv, int64_t d0,
                           const int nc) {
    v16f a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < nc; c++) memcpy(&a[r][c], acc + r * Dv + d0 + c * V, sizeof(v16f));
    for (int64_t j = 0; j < nb; j++) {
        v16f x[4];
        for (int c = 0; c < nc; c++) memcpy(&x[c], vr[j] + d0 + c * V, sizeof(v16f));
        for (int r = 0; r < 4; r++) {
            const float w = p[r * BLOCK + j];
            for (int c = 0; c < nc; c++) a[r][c] += w * x[c];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < nc; c++) memcpy(acc + r * Dv + d0 + c * V, &a[r][c], sizeof(v16f));
}

/* The values of a block into rows [r0, r0 + 4): columns in chunks of up to four vectors, a scalar tail */
static void values_rows(const float *const *vr, int64_t nb, const float *p, float *acc, int64_t Dv) {
    int64_t d0 = 0;
    for (; d0 + 4 * V <= Dv; d0 += 4 * V) values4(vr, nb, p, acc, Dv, d0, 4);
    switch ((Dv - d0) / V) {
    case 3: values4(vr, nb, p, acc, Dv, d0, 3); break;
    case 2: values4(vr, nb, p, acc, Dv, d0, 2); break;
    case 1: values4(vr, nb, p, acc, Dv, d0, 1); break;
    }
    for (int64_t d = d0 + (Dv - d0) / V * V; d < Dv; d++)
        for (int r = 0; r < 4; r++)
            for (int64_t j = 0; j < nb; j++) acc[r * Dv + d] += p[r * BLOCK + j] * vr[j][d];
}

/* Row r's block scores p[0, nv V) (scaled here) folded into its running max and sum, the accumulator
 * rescaled on a new max; p becomes exp(score - max) for the lim keys it sees, 0 past them */
static void softmax_row(float *p, int64_t nv, int64_t lim, float scale, float *acc, int64_t Dv, float *m, float *l) {
    const v16f neg = (v16f){0} - INFINITY;
    v16f x[BLOCK / V], mx = neg;
    v16i iota;
    for (int i = 0; i < V; i++) iota[i] = i;
    for (int64_t c = 0; c < nv; c++) {
        memcpy(&x[c], p + c * V, sizeof(v16f));
        v16i seen = iota + (int32_t)(c * V) < (int32_t)lim;
        x[c] = (v16f)(((v16i)(x[c] * scale) & seen) | ((v16i)neg & ~seen));
        v16i keep = mx > x[c];
        mx = (v16f)(((v16i)mx & keep) | ((v16i)x[c] & ~keep));
    }
    float bm = mx[0];
    for (int i = 1; i < V; i++) bm = mx[i] > bm ? mx[i] : bm;
    float mn = bm > *m ? bm : *m;
    if (mn > *m && *l > 0) { /* a new max: the running sum and output shrink by exp(old - new) */
        float a = expf(*m - mn);
        *l *= a;
        scale_row(acc, a, Dv);
    }
    *m = mn;
    v16f sum = {0};
    for (int64_t c = 0; c < nv; c++) {
        v16i seen = iota + (int32_t)(c * V) < (int32_t)lim;
        v16f e = (v16f)((v16i)vexp(x[c] - mn) & seen);
        sum += e;
        memcpy(p + c * V, &e, sizeof(v16f));
    }
    v8f h = __builtin_shufflevector(sum, sum, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(sum, sum, 8, 9, 10, 11, 12, 13, 14, 15);
    *l += ((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7]));
}

/* Tile t of a unit: R = G x nq query rows (row i * G + g: position i0 + i, query head h * G + g),
 * padded to R4, a multiple of 4, with rows that see no key; its first nk keys (prefix + i0 + nq).
 * Scratch (floats) per tile: qt [R4, Dk], acc [R4, Dv], m [R4], l [R4], cap (R4's bound) rows each. */
typedef struct {
    int64_t i0, nq, R, R4, nk;
    float *qt, *acc, *m, *l;
} tile_t;

static void tile_start(const job_t *jb, int64_t b, int64_t h, int64_t i0, float *mem, int64_t cap, tile_t *t) {
    const int64_t G = jb->G, Dk = jb->Dk, Dv = jb->Dv, Hq = jb->Hq;
    t->i0 = i0, t->nq = jb->ext[b] - i0 < TILE ? jb->ext[b] - i0 : TILE;
    t->R = t->nq * G, t->R4 = (t->R + 3) / 4 * 4, t->nk = jb->prefix[b] + i0 + t->nq;
    t->qt = mem, t->acc = mem + cap * Dk, t->m = t->acc + cap * Dv, t->l = t->m + cap;
    const float *q0 = jb->q + ((jb->q_start[b] + i0) * Hq + h * G) * Dk; /* row (i, g) at q0 + i Hq Dk + g Dk */
    for (int64_t i = 0; i < t->nq; i++) /* loops, not memcpy: rows of a few hundred bytes, a libc call each */
        for (int64_t x = 0; x < G * Dk; x++) t->qt[i * G * Dk + x] = q0[i * Hq * Dk + x];
    for (int64_t x = t->R * Dk; x < t->R4 * Dk; x++) t->qt[x] = 0.0f;
    for (int64_t x = 0; x < t->R4 * Dv; x++) t->acc[x] = 0.0f;
    for (int64_t r = 0; r < t->R4; r++) t->m[r] = -INFINITY, t->l[r] = 0.0f;
}

/* One key block [j0, j0 + nb) of a tile (nb within its nk): scores, each row's softmax, the values */
static void tile_block(const job_t *jb, const tile_t *t, int64_t pre, int64_t j0, int64_t nb, const float *kt,
                       const float *const *vr, float *sc) {
    const int64_t Dk = jb->Dk, Dv = jb->Dv, G = jb->G, nv = (nb + V - 1) / V;
    for (int64_t r = 0; r < t->R4; r += 4) switch (nv) {
        case 1: scores4(t->qt + r * Dk, kt, Dk, sc + r * BLOCK, 1); break;
        case 2: scores4(t->qt + r * Dk, kt, Dk, sc + r * BLOCK, 2); break;
        case 3: scores4(t->qt + r * Dk, kt, Dk, sc + r * BLOCK, 3); break;
        default: scores4(t->qt + r * Dk, kt, Dk, sc + r * BLOCK, 4); break;
        }
    for (int64_t r = 0; r < t->R4; r++) {
        const int64_t seen = r < t->R ? pre + t->i0 + r / G + 1 - j0 : 0; /* keys of this block row r sees */
        softmax_row(sc + r * BLOCK, nv, seen < nb ? seen : nb, jb->scale, t->acc + r * Dv, Dv, t->m + r, t->l + r);
    }
    for (int64_t r = 0; r < t->R4; r += 4) values_rows(vr, nb, sc + r * BLOCK, t->acc + r * Dv, Dv);
}

/* Unit u: group u / Hkv (up to GROUP tiles of one request), KV head u % Hkv. Each key block is read
 * and transposed once for the group's tiles that see it; each tile's operations are those it would
 * run alone, in the same order. Scratch (floats): kt [Dk, BLOCK], sc [cap, BLOCK], then GROUP tiles'. */
static void attend_group(const void *arg, int64_t u, void *scratch) {
    const job_t *jb = arg;
    const int64_t gi = u / jb->Hkv, h = u % jb->Hkv, b = jb->group_req[gi], i0 = jb->group_row[gi];
    const int64_t Dk = jb->Dk, Dv = jb->Dv, pre = jb->prefix[b], cap = (jb->G * TILE + 3) / 4 * 4;
    float *kt = scratch, *sc = kt + Dk * BLOCK, *mem = sc + cap * BLOCK;
    const int64_t *sl = jb->kv_slots + b * jb->slot_stride;
    const float *kr[BLOCK], *vr[BLOCK];
    tile_t tiles[GROUP];
    int64_t n = 0, nk = 0;
    for (; n < GROUP && i0 + n * TILE < jb->ext[b]; n++) {
        tile_start(jb, b, h, i0 + n * TILE, mem + n * cap * (Dk + Dv + 2), cap, &tiles[n]);
        nk = tiles[n].nk;
    }
    for (int64_t j0 = 0; j0 < nk; j0 += BLOCK) {
        const int64_t nb = nk - j0 < BLOCK ? nk - j0 : BLOCK;
        block_rows(jb, sl + j0, nb, h, kr, vr);
        transpose_keys(kr, nb, (nb + V - 1) / V, Dk, kt);
        for (int64_t x = 0; x < n; x++)
            if (tiles[x].nk > j0) tile_block(jb, &tiles[x], pre, j0, tiles[x].nk - j0 < nb ? tiles[x].nk - j0 : nb,
                                             kt, vr, sc);
    }
    for (int64_t x = 0; x < n; x++) {
        const tile_t *t = &tiles[x];
        for (int64_t r = 0; r < t->R; r++) {
            float *o = jb->out + ((jb->q_start[b] + t->i0 + r / jb->G) * jb->Hq + h * jb->G + r % jb->G) * Dv;
            const float a = 1.0f / t->l[r];
            for (int64_t d = 0; d < Dv; d++) o[d] = t->acc[r * Dv + d] * a;
        }
    }
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
    const int64_t G = Hq / Hkv, cap = (G * TILE + 3) / 4 * 4;
    const int64_t floats = Dk * BLOCK + cap * BLOCK + GROUP * cap * (Dk + Dv + 2);
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
