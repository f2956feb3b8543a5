/* DeepSeek-V3.2's lightning indexer on CPU, fused: score every visible token of a query straight
 * from the paged index-key pool (by slot, no gathered copy, no [B, Hi, L] score tensor) and keep
 * its top k while scoring, in one pass over the keys.
 *
 * Legend: T query rows, Hi index heads, Di index head dim, L kv_slots' width (longest sequence),
 * k picks (min(topk, L)), n tokens a query sees (vis[t]), N pool slots.
 *
 * Picks are those of pdserve's torch twin (``select_top_tokens`` / ``topk_first_on_ties``): the k
 * largest scores, ties at the cut taken from the lowest position up, returned as positions in
 * ascending order; a query seeing n <= k tokens keeps them all, and its padding picks are the
 * positions after them (n, n+1, ...), as the twin's -inf scores tie from the lowest position.
 *
 * Selection: a min-heap of the k best so far, the worst at its root (lowest score; among equal
 * scores the highest position). Keys stream in position order, so a later score equal to the
 * root's loses the tie: only a strictly greater score enters. That is the first-on-ties rule
 * without a second pass, and on typical scores only O(k log(n / k)) keys ever enter the heap.
 *
 * Built by pdserve_kernels/index_topk_cpu.py with the system compiler; plain C99 plus GCC/Clang
 * vector extensions (no torch headers).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

enum { OK = 0, NON_FINITE = 1, BAD_SLOT = 2, NO_MEMORY = 3, BAD_REQ = 4, BAD_VIS = 5 };

#ifndef PREFETCH
#define PREFETCH 16  /* keys ahead of the one scored */
#endif


typedef struct {
    float s;
    int64_t j;
} pick_t;

/* a is worse than b: a lower score, or an equal score at a higher position */
static inline int worse(pick_t a, pick_t b) { return a.s < b.s || (a.s == b.s && a.j > b.j); }

static void sift_down(pick_t *h, int64_t n, int64_t i) {
    pick_t x = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && worse(h[c + 1], h[c])) c++;
        if (!worse(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

typedef int32_t v4i __attribute__((vector_size(16)));

/* q . k over Di floats: 8 lanes of partial sums, then a fixed tree, so equal keys score equally */
static inline float dot(const float *q, const float *k, int64_t Di) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= Di; d += 8) {
        v8f x, y;
        memcpy(&x, q + d, sizeof x);
        memcpy(&y, k + d, sizeof y);
        acc += x * y;
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < Di; d++) s += q[d] * k[d];
    return s;
}

/* sum_h w[h] * relu(q[h] . k), w already times the scale (relu(scale x) = scale relu(x), scale > 0).
 * Heads four at a time: each key vector is loaded once for the four. */
static inline float score(const float *q, const float *w, const float *k, int64_t Hi, int64_t Di) {
    v4f acc4 = {0, 0, 0, 0};
    int64_t h = 0;
    for (; h + 4 <= Hi; h += 4) {
        const float *q0 = q + h * Di;
        v4f x = dot4(k, q0, q0 + Di, q0 + 2 * Di, q0 + 3 * Di, Di);
        v4f wv;
        memcpy(&wv, w + h, sizeof wv);
        x = (v4f)(((v4i)(x > 0.0f) | (v4i)(x != x)) & (v4i)x);  /* ReLU; a NaN stays one, as in torch */
        acc4 += wv * x;
    }
    float s = (acc4[0] + acc4[1]) + (acc4[2] + acc4[3]);
    for (; h < Hi; h++) {
        float x = dot(q + h * Di, k, Di);
        s += w[h] * (x > 0.0f || x != x ? x : 0.0f);  /* ReLU; a NaN stays one */
    }
    return s;
}

static inline int is_finite(float x) { return x == x && x - x == 0.0f; }

/* One block of query rows of the same request (t0 .. t0 + nq - 1), each seeing more than k tokens:
 * every key is read once for the whole block. */
static inline __attribute__((always_inline)) int select_block(const float *q, const float *ws, const float *keys,
                                                              int64_t N, const int64_t *slots, const int64_t *vis,
                                                              int64_t t0, int64_t nq, int64_t Hi, int64_t Di,
                                                              int64_t k, pick_t *heaps, int64_t *out) {
    int64_t nmax = 0;
    for (int64_t i = 0; i < nq; i++) nmax = vis[t0 + i] > nmax ? vis[t0 + i] : nmax;
    for (int64_t j = 0; j < nmax; j++) {
        int64_t slot = slots[j];
        if (slot < 0 || slot >= N) return BAD_SLOT;
        if (j + PREFETCH < nmax) {  /* pages lie anywhere in the pool: ask for a later key's lines now */
            int64_t ahead = slots[j + PREFETCH];
            if (ahead >= 0 && ahead < N)
                for (int64_t d = 0; d < Di; d += 16) __builtin_prefetch(keys + ahead * Di + d);
        }
        const float *key = keys + slot * Di;
        for (int64_t i = 0; i < nq; i++) {
            int64_t t = t0 + i;
            if (j >= vis[t]) continue;
            float s = score(q + t * Hi * Di, ws + t * Hi, key, Hi, Di);
            if (!is_finite(s)) return NON_FINITE;
            pick_t *h = heaps + i * k;
            if (j < k) {  /* the first k fill the heap; it is ordered once full */
                h[j].s = s;
                h[j].j = j;
                if (j == k - 1)
                    for (int64_t p = k / 2 - 1; p >= 0; p--) sift_down(h, k, p);
            } else if (s > h[0].s) {
                h[0].s = s;
                h[0].j = j;
                sift_down(h, k, 0);
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        int64_t *o = out + (t0 + i) * k;
        for (int64_t p = 0; p < k; p++) o[p] = heaps[i * k + p].j;
        qsort(o, (size_t)k, sizeof *o, cmp_i64);
    }
    return OK;
}

/* q [T, Hi, Di], w [T, Hi], keys: one layer's pool [N, Di] (row = slot), kv_slots [B, ld] (row b's
 * first L entries are request b's slots in position order), req [T] row of kv_slots (< B), vis [T]
 * tokens seen (<= L) -> out [T, k] positions, ascending. Returns OK, NON_FINITE (a score is NaN or
 * infinite: the caller runs the twin, whose rule for those it is), BAD_SLOT, BAD_REQ, BAD_VIS or
 * NO_MEMORY. max_block: query rows of one request scored together. */
int pdserve_index_topk_f32(const float *q, const float *w, const float *keys, int64_t N, const int64_t *kv_slots,
                           int64_t B, int64_t L, int64_t ld, const int64_t *req, const int64_t *vis, int64_t T,
                           int64_t Hi, int64_t Di, double scale, int64_t k, int64_t max_block, int64_t *out) {
    for (int64_t t = 0; t < T; t++) {
        if (req[t] < 0 || req[t] >= B) return BAD_REQ;
        if (vis[t] < 0 || vis[t] > L) return BAD_VIS;
    }
    if (k <= 0) return OK;
    float *ws = malloc(sizeof(float) * (size_t)(T * Hi + 1));
    pick_t *heaps = malloc(sizeof(pick_t) * (size_t)(max_block * k));
    int rc = ws && heaps ? OK : NO_MEMORY;
    for (int64_t i = 0; rc == OK && i < T * Hi; i++) ws[i] = w[i] * (float)scale;
    int64_t t = 0;
    while (rc == OK && t < T) {
        if (vis[t] <= k) {  /* keeps every token it sees, then the positions after them */
            for (int64_t p = 0; p < k; p++) out[t * k + p] = p;
            t++;
            continue;
        }
        int64_t nq = 1;  /* this row and the following rows of the same request that also select */
        while (nq < max_block && t + nq < T && req[t + nq] == req[t] && vis[t + nq] > k) nq++;
        const int64_t *slots = kv_slots + req[t] * ld;
        switch (Di) {  /* the common widths get their own copy, the loop over Di unrolled */
        case 32: rc = select_block(q, ws, keys, N, slots, vis, t, nq, Hi, 32, k, heaps, out); break;
        case 64: rc = select_block(q, ws, keys, N, slots, vis, t, nq, Hi, 64, k, heaps, out); break;
        case 128: rc = select_block(q, ws, keys, N, slots, vis, t, nq, Hi, 128, k, heaps, out); break;
        default: rc = select_block(q, ws, keys, N, slots, vis, t, nq, Hi, Di, k, heaps, out);
        }
        t += nq;
    }
    free(ws);
    free(heaps);
    return rc;
}
