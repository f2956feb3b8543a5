/* Decode attention on CPU (one query row per request), reading each request's keys and values by
 * slot straight from the paged pool: no gathered or staged copy, no padded mask, no permutes.
 *
 * Legend: B requests, Hq query heads, Hkv KV heads, G = Hq / Hkv query heads per KV head,
 * Dk key (and query) width, Dv value width, L kv_slots' width, n a request's length (seq_lens[b]),
 * N pool slots (pages * page size S).
 *
 * Slot s is row (s % S) of page s / S; key row of KV head h at slot s starts at
 *   k + (s / S) * k_page + h * k_head + (s % S) * k_token
 * (the same for v with its strides). GQA's HND pool [P, Hkv, S, D] and MLA's latent [P, S, C+R]
 * (one KV "head", head stride 0, values the first C columns of the same row, v == k) are both
 * this form, so absorbed MLA decode is the same call.
 *
 * Query head h reads KV head h / G. A KV head's G query heads run together, so each key and value
 * row is read once per (request, KV head). Keys go in blocks of BLOCK: the block's G x BLOCK
 * scores first (four keys at a time), then one rescale of the running output per block (online
 * softmax: running max m, running sum l), then the values. Float accumulation throughout; the
 * output row doubles as the accumulator.
 *
 * Decode attention reads each row once, so it waits on memory, not on arithmetic, and only
 * prefetching far enough ahead hides that: two streams of prefetches run beside the compute.
 * Into L1, the next block's rows of the head about to run (one block ahead). Into L2, a cursor
 * AHEAD_BYTES of rows ahead of the compute, across the requests of the call (or of the thread's
 * unit): at each block it moves one block further, every head's key and value rows. Measured on
 * a 2-core VM (benchmark/bench_decode_attention.py), 32 requests of 161 keys, 8 query and 4 KV
 * heads of 32, four layers' pools in turn (so each layer's rows come from memory, as in a decode
 * step): the L1 stream alone left the kernel at 0.55 ms a layer (page size 1), against 0.23 ms
 * with the rows in cache, because the out-of-order core keeps only a few rows' loads in flight; the
 * L2 cursor brought it to 0.33 ms (docs/cpu.md). Prefetches never fault and change no result.
 *
 * Built by pdserve_kernels/decode_attention_cpu.py with the system compiler; plain C99 plus
 * GCC/Clang vector extensions (no torch headers). Not torch's OpenMP: its own helper threads
 * (cpu_threads.h) take groups of requests beside the caller.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"

enum { OK = 0, BAD_SLOT = 1, BAD_LEN = 2, NO_MEMORY = 3 };

#ifndef BLOCK
#define BLOCK 64 /* keys per softmax block: G x BLOCK scores stay in L1 */
#endif
#ifndef AHEAD_BYTES
#define AHEAD_BYTES (64 * 1024) /* how far the L2 cursor runs ahead of the compute (0: no cursor) */
#endif

typedef struct {
    const float *k, *v;
    int64_t S, k_page, k_head, k_token, v_page, v_head, v_token, Dk, Dv, G;
    float scale;
    int shift; /* log2(S) where S is a power of two, else -1 */
} pool_t;

/* Each slot's row offsets (elements) in the k and v buffers, head 0: computed once per block and
 * shared by every head */
static void row_offsets(const pool_t *c, const int64_t *slots, int64_t nb, int64_t *ko, int64_t *vo) {
    for (int64_t j = 0; j < nb; j++) {
        int64_t page, off;
        slot_page(slots[j], c->shift, c->S, &page, &off);
        ko[j] = page * c->k_page + off * c->k_token;
        vo[j] = page * c->v_page + off * c->v_token;
    }
}

/* Start loading a block's key and value rows of head h (the next block's, while this one computes):
 * the rows of a page are contiguous, but page boundaries break the hardware's streams */
static void prefetch_block(const pool_t *c, const int64_t *ko, const int64_t *vo, int64_t nb, int64_t h) {
    for (int64_t j = 0; j < nb; j++) {
        const float *kr = c->k + ko[j] + h * c->k_head, *vr = c->v + vo[j] + h * c->v_head;
        for (int64_t x = 0; x < c->Dk; x += 16) __builtin_prefetch(kr + x);
        for (int64_t x = 0; x < c->Dv; x += 16) __builtin_prefetch(vr + x);
    }
}

/* Every line of a row of n floats at r, into L2 */
static inline void prefetch_row_l2(const float *r, int64_t n) {
    const char *line = (const char *)((uintptr_t)r & ~(uintptr_t)63), *end = (const char *)(r + n);
    for (; line < end; line += 64) __builtin_prefetch(line, 0, 1);
}

/* The L2 cursor: request b, key j of the job's requests up to b1 (the thread's unit) */
typedef struct {
    int64_t b, j, b1;
} cursor_t;

/* Move the cursor `rows` keys further (within its requests), every head's key and value rows of the
 * keys it passes into L2. kv_slots and seq_lens were checked (check_requests) for every request. */
static void prefetch_ahead(const pool_t *c, const int64_t *kv_slots, int64_t stride, const int64_t *seq_lens,
                           int64_t Hkv, cursor_t *cur, int64_t rows) {
    const int same = c->v == c->k; /* MLA's latent: the values are the keys' rows */
    while (rows > 0 && cur->b < cur->b1) {
        const int64_t n = seq_lens[cur->b];
        if (cur->j >= n) {
            cur->b++, cur->j = 0;
            continue;
        }
        const int64_t *sl = kv_slots + cur->b * stride;
        const int64_t take = n - cur->j < rows ? n - cur->j : rows;
        for (int64_t j = cur->j; j < cur->j + take; j++) {
            int64_t page, off;
            slot_page(sl[j], c->shift, c->S, &page, &off);
            for (int64_t h = 0; h < Hkv; h++) {
                prefetch_row_l2(c->k + page * c->k_page + h * c->k_head + off * c->k_token, c->Dk);
                if (!same) prefetch_row_l2(c->v + page * c->v_page + h * c->v_head + off * c->v_token, c->Dv);
            }
        }
        cur->j += take, rows -= take;
    }
}

/* One KV block of one (request, KV head): scores, one rescale per query head, then the values */
static void attend_block(const pool_t *c, const int64_t *ko, const int64_t *vo, int64_t nb, int64_t h,
                         const float *q, float *o, float *sc, float *m, float *l) {
    const int64_t G = c->G, Dk = c->Dk, Dv = c->Dv;
    const float *kr[BLOCK], *vr[BLOCK];
    for (int64_t j = 0; j < nb; j++) {
        kr[j] = c->k + ko[j] + h * c->k_head;
        vr[j] = c->v + vo[j] + h * c->v_head;
    }
    for (int64_t g = 0; g < G; g++) scores(q + g * Dk, kr, nb, Dk, c->scale, sc + g * BLOCK);
    for (int64_t g = 0; g < G; g++) {
        float *p = sc + g * BLOCK, bm = p[0];
        for (int64_t j = 1; j < nb; j++) bm = p[j] > bm ? p[j] : bm;
        float mn = bm > m[g] ? bm : m[g];
        if (mn > m[g] && l[g] > 0) {  /* a new max: the running sum and output shrink by exp(old - new) */
            float a = expf(m[g] - mn);
            l[g] *= a;
            scale_row(o + g * Dv, a, Dv);
        }
        m[g] = mn;
        l[g] += exp_shifted(p, nb, mn);
    }
    accumulate_values(vr, nb, sc, BLOCK, o, G, Dv);
}

typedef struct {
    pool_t c;
    const float *q;
    float *out;
    const int64_t *kv_slots, *seq_lens;
    int64_t B, Hq, Hkv, slot_stride, per_unit;
} job_t;

/* Requests [b0, b1) of a call, in order, with the scratch of the thread running them (G x BLOCK
 * scores, then Hq running maxima and Hq running sums) */
static void attend_requests(const job_t *jb, int64_t b0, int64_t b1, float *sc) {
    const pool_t *c = &jb->c;
    const int64_t G = c->G, Dk = c->Dk, Dv = c->Dv, Hq = jb->Hq, Hkv = jb->Hkv, stride = jb->slot_stride;
    const int64_t *seq_lens = jb->seq_lens;
    float *m = sc + G * BLOCK, *l = m + Hq;
    int64_t ofs[4][BLOCK]; /* this block's and the next block's k and v row offsets */
    int64_t *ko = ofs[0], *vo = ofs[1], *nko = ofs[2], *nvo = ofs[3];
    /* the L2 cursor starts `ahead` keys in: AHEAD_BYTES of rows, at least a block */
    const int64_t row_bytes = (int64_t)sizeof(float) * Hkv * (c->Dk + (c->v == c->k ? 0 : Dv));
    const int64_t ahead = AHEAD_BYTES == 0 ? 0 : AHEAD_BYTES / row_bytes > BLOCK ? AHEAD_BYTES / row_bytes : BLOCK;
    cursor_t cur = {b0, 0, b1};
    if (ahead > 0) prefetch_ahead(c, jb->kv_slots, stride, seq_lens, Hkv, &cur, ahead);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t n = seq_lens[b], *sl = jb->kv_slots + b * stride;
        float *o = jb->out + b * Hq * Dv;
        memset(o, 0, sizeof(float) * (size_t)(Hq * Dv));
        for (int64_t i = 0; i < Hq; i++) m[i] = -INFINITY, l[i] = 0.0f;
        if (b == b0) {
            row_offsets(c, sl, n < BLOCK ? n : BLOCK, nko, nvo);
            for (int64_t h = 0; h < Hkv; h++) prefetch_block(c, nko, nvo, n < BLOCK ? n : BLOCK, h);
        }
        /* blocks outside, heads inside: a page's rows (all heads) are read in memory order, and the
         * next block's rows of a head load while this block's same head computes. nko/nvo hold this
         * block's offsets on entry (computed as the previous block's "next"). */
        for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {
            int64_t *t;
            t = ko, ko = nko, nko = t;
            t = vo, vo = nvo, nvo = t;
            const int64_t *next = j0 + BLOCK < n ? sl + j0 + BLOCK : b + 1 < b1 ? sl + stride : NULL;
            int64_t nn = j0 + BLOCK < n ? n - j0 - BLOCK : b + 1 < b1 ? seq_lens[b + 1] : 0;
            nn = nn < BLOCK ? nn : BLOCK;
            if (next != NULL) row_offsets(c, next, nn, nko, nvo);
            if (ahead > 0) prefetch_ahead(c, jb->kv_slots, stride, seq_lens, Hkv, &cur, n - j0 < BLOCK ? n - j0 : BLOCK);
            for (int64_t h = 0; h < Hkv; h++) {
                if (next != NULL) prefetch_block(c, nko, nvo, nn, h);
                attend_block(c, ko, vo, n - j0 < BLOCK ? n - j0 : BLOCK, h, jb->q + (b * Hq + h * G) * Dk,
                             o + h * G * Dv, sc, m + h * G, l + h * G);
            }
        }
        for (int64_t i = 0; i < Hq; i++) scale_row(o + i * Dv, 1.0f / l[i], Dv);
    }
}

/* Helper threads share a call's requests: unit i is requests [i * per_unit, (i + 1) * per_unit) */
#include "cpu_threads.h"

static void attend_unit(const void *arg, int64_t i, void *sc) {
    const job_t *jb = arg;
    int64_t b0 = i * jb->per_unit, b1 = b0 + jb->per_unit;
    attend_requests(jb, b0, b1 < jb->B ? b1 : jb->B, sc);
}

/* Every length in [1, L] and every slot a request reads in [0, N): OK, BAD_LEN or BAD_SLOT */
static int check_requests(int64_t B, const int64_t *kv_slots, int64_t L, int64_t slot_stride,
                          const int64_t *seq_lens, int64_t N) {
    for (int64_t b = 0; b < B; b++) {
        int64_t n = seq_lens[b];
        if (n < 1 || n > L) return BAD_LEN;
        const int64_t *sl = kv_slots + b * slot_stride;
        for (int64_t j = 0; j < n; j++)
            if (sl[j] < 0 || sl[j] >= N) return BAD_SLOT;
    }
    return OK;
}

/* Floats of scratch one thread needs for G query heads per KV head and Hq heads */
static int64_t scratch_floats(int64_t G, int64_t Hq) { return G * BLOCK + 2 * Hq; }

static pool_t pool_of(const float *k, const float *v, int64_t S, int64_t k_page, int64_t k_head, int64_t k_token,
                      int64_t v_page, int64_t v_head, int64_t v_token, int64_t Dk, int64_t Dv, int64_t G,
                      float scale) {
    pool_t c = {k, v, S, k_page, k_head, k_token, v_page, v_head, v_token, Dk, Dv, G, scale, page_shift(S)};
    return c;
}

/* The attention of requests already checked (check_requests), sc: the caller's scratch_floats */
static void attend(const pool_t *c, const float *q, float *out, const int64_t *kv_slots, int64_t slot_stride,
                   const int64_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv, float *sc, int64_t threads,
                   int64_t per_unit) {
    if (per_unit < 1) per_unit = 1;
    int64_t units = (B + per_unit - 1) / per_unit;
    job_t jb = {*c, q, out, kv_slots, seq_lens, B, Hq, Hkv, slot_stride, per_unit};
    if (threads <= 1 || units < 2) /* all requests in one run: the next request's rows prefetched across units */
        attend_requests(&jb, 0, B, sc);
    else
        cpu_threads_run(attend_unit, &jb, units, (int64_t)sizeof(float) * scratch_floats(c->G, Hq), sc, threads);
}

/* q [B, Hq, Dk] and out [B, Hq, Dv] contiguous; kv_slots [B, L] with row stride slot_stride;
 * seq_lens [B]. Every length must lie in [1, L] and every slot a request reads in [0, N):
 * checked before any read of the pool. threads > 1: helper threads take units of per_unit
 * requests beside the caller (the result is the same: each request is computed whole, by one
 * thread, in the same order of operations). */
int pdserve_decode_attention_f32(const float *q, int64_t B, int64_t Hq, int64_t Dk, const float *k,
                                 const float *v, int64_t N, int64_t S, int64_t Hkv, int64_t k_page,
                                 int64_t k_head, int64_t k_token, int64_t v_page, int64_t v_head, int64_t v_token,
                                 int64_t Dv, const int64_t *kv_slots, int64_t L, int64_t slot_stride,
                                 const int64_t *seq_lens, double scale, float *out, int64_t threads,
                                 int64_t per_unit) {
    int rc = check_requests(B, kv_slots, L, slot_stride, seq_lens, N);
    if (rc != OK) return rc;
    const int64_t G = Hq / Hkv;
    float *sc = malloc(sizeof(float) * (size_t)scratch_floats(G, Hq));
    if (sc == NULL) return NO_MEMORY;
    pool_t c = pool_of(k, v, S, k_page, k_head, k_token, v_page, v_head, v_token, Dk, Dv, G, (float)scale);
    attend(&c, q, out, kv_slots, slot_stride, seq_lens, B, Hq, Hkv, sc, threads, per_unit);
    free(sc);
    return OK;
}
