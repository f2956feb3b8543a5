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
#define TILE 16 /* query positions per unit: G x TILE rows of scores, BLOCK wide */
#endif

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int64_t *kv_slots, *prefix, *ext, *q_start, *tile_req, *tile_row;
    int64_t S, k_page, k_head, k_token, v_page, v_head, v_token, Hq, Hkv, G, Dk, Dv, slot_stride;
    float scale;
    int shift; /* log2(S) where S is a power of two, else -1 */
} job_t;

/* Key and value rows of KV head h for slots sl[0..nb) */
static void block_rows(const job_t *jb, const int64_t *sl, int64_t nb, int64_t h, const float **kr, const float **vr) {
    for (int64_t j = 0; j < nb; j++) {
        int64_t s = sl[j], page, off;
        if (jb->shift >= 0)
            page = s >> jb->shift, off = s & (jb->S - 1);
        else
            page = s / jb->S, off = s % jb->S;
        kr[j] = jb->k + page * jb->k_page + h * jb->k_head + off * jb->k_token;
        vr[j] = jb->v + page * jb->v_page + h * jb->v_head + off * jb->v_token;
    }
}

/* Row r's scores over the first lim of a block's nb keys, folded into its running max and sum (the
 * accumulator rescaled on a new max); p[lim..nb) zeroed, so the values' pass adds nothing for them */
static void softmax_row(const job_t *jb, const float *qr, const float *const *kr, int64_t nb, int64_t lim, float *p,
                        float *acc, float *m, float *l) {
    if (lim <= 0) {
        memset(p, 0, sizeof(float) * (size_t)nb);
        return;
    }
    scores(qr, kr, lim, jb->Dk, jb->scale, p);
    float bm = p[0];
    for (int64_t j = 1; j < lim; j++) bm = p[j] > bm ? p[j] : bm;
    float mn = bm > *m ? bm : *m;
    if (mn > *m && *l > 0) { /* a new max: the running sum and output shrink by exp(old - new) */
        float a = expf(*m - mn);
        *l *= a;
        scale_row(acc, a, jb->Dv);
    }
    *m = mn;
    *l += exp_shifted(p, lim, mn);
    if (lim < nb) memset(p + lim, 0, sizeof(float) * (size_t)(nb - lim));
}

/* Unit u: tile u / Hkv, KV head u % Hkv. Scratch: R x BLOCK scores, R x Dv accumulators, R maxima,
 * R sums, for R = G x TILE rows (row i * G + g: position i0 + i, query head h * G + g). */
static void attend_tile(const void *arg, int64_t u, void *scratch) {
    const job_t *jb = arg;
    const int64_t t = u / jb->Hkv, h = u % jb->Hkv, b = jb->tile_req[t], i0 = jb->tile_row[t];
    const int64_t G = jb->G, Dk = jb->Dk, Dv = jb->Dv, Hq = jb->Hq, pre = jb->prefix[b];
    const int64_t nq = jb->ext[b] - i0 < TILE ? jb->ext[b] - i0 : TILE, R = nq * G, nk = pre + i0 + nq;
    float *sc = scratch, *acc = sc + G * TILE * BLOCK, *m = acc + G * TILE * Dv, *l = m + G * TILE;
    const int64_t *sl = jb->kv_slots + b * jb->slot_stride;
    const float *q0 = jb->q + ((jb->q_start[b] + i0) * Hq + h * G) * Dk; /* row (i, g) at q0 + i Hq Dk + g Dk */
    const float *kr[BLOCK], *vr[BLOCK];
    memset(acc, 0, sizeof(float) * (size_t)(R * Dv));
    for (int64_t r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int64_t j0 = 0; j0 < nk; j0 += BLOCK) {
        const int64_t nb = nk - j0 < BLOCK ? nk - j0 : BLOCK;
        block_rows(jb, sl + j0, nb, h, kr, vr);
        for (int64_t i = 0; i < nq; i++) {
            const int64_t seen = pre + i0 + i + 1 - j0, lim = seen < nb ? seen : nb; /* keys of this block it sees */
            for (int64_t g = 0; g < G; g++) {
                const int64_t r = i * G + g;
                softmax_row(jb, q0 + i * Hq * Dk + g * Dk, kr, nb, lim, sc + r * BLOCK, acc + r * Dv, m + r, l + r);
            }
        }
        accumulate_values(vr, nb, sc, BLOCK, acc, R, Dv);
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g;
            float *o = jb->out + ((jb->q_start[b] + i0 + i) * Hq + h * G + g) * Dv;
            scale_row(acc + r * Dv, 1.0f / l[r], Dv);
            memcpy(o, acc + r * Dv, sizeof(float) * (size_t)Dv);
        }
}

/* Every length and every slot a request reads, checked before any read of the pool; the number of
 * query tiles, or a negative error code */
static int64_t check(const int64_t *prefix, const int64_t *ext, int64_t B, int64_t T, const int64_t *kv_slots,
                     int64_t L, int64_t slot_stride, int64_t N) {
    int64_t total = 0, tiles = 0;
    for (int64_t b = 0; b < B; b++) {
        if (ext[b] < 1) return -BAD_EXT;
        if (prefix[b] < 0 || prefix[b] > L - ext[b]) return -BAD_PREFIX;
        total += ext[b], tiles += (ext[b] + TILE - 1) / TILE;
    }
    if (total != T) return -BAD_TOTAL;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *sl = kv_slots + b * slot_stride, n = prefix[b] + ext[b];
        for (int64_t j = 0; j < n; j++)
            if (sl[j] < 0 || sl[j] >= N) return -BAD_SLOT;
    }
    return tiles;
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
    const int64_t tiles = check(prefix, ext, B, T, kv_slots, L, slot_stride, N);
    if (tiles < 0) return (int)-tiles;
    const int64_t G = Hq / Hkv, floats = G * TILE * (BLOCK + Dv + 2);
    int64_t *index = malloc(sizeof(int64_t) * (size_t)(B + 2 * tiles + 1));
    float *sc = malloc(sizeof(float) * (size_t)floats);
    if (index == NULL || sc == NULL) {
        free(index), free(sc);
        return NO_MEMORY;
    }
    int64_t *q_start = index, *tile_req = q_start + B, *tile_row = tile_req + tiles, n = 0, work = 0;
    for (int64_t b = 0, start = 0; b < B; start += ext[b], b++) {
        q_start[b] = start;
        work += ext[b] * (prefix[b] + (ext[b] + 1) / 2) * Hq;
        for (int64_t i0 = 0; i0 < ext[b]; i0 += TILE) tile_req[n] = b, tile_row[n++] = i0;
    }
    int shift = -1;
    if ((S & (S - 1)) == 0)
        for (shift = 0; ((int64_t)1 << shift) < S; shift++) {}
    job_t jb = {q, k, v, out, kv_slots, prefix, ext, q_start, tile_req, tile_row, S, k_page, k_head, k_token,
                v_page, v_head, v_token, Hq, Hkv, G, Dk, Dv, slot_stride, (float)scale, shift};
    cpu_threads_run(attend_tile, &jb, tiles * Hkv, (int64_t)sizeof(float) * floats, sc,
                    work < min_scores ? 1 : threads);
    free(index), free(sc);
    return OK;
}
