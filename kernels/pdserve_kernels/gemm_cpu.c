/* Small-M float32 GEMM for CPU decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), on a weight
 * packed once into panels of PANEL columns.
 *
 * Legend: M rows (tokens), K in features, N out features, P = ceil(N / PANEL) panels.
 *
 * Packed weight wp [P, K, PANEL]: wp[p][k][j] = W[p * PANEL + j][k], columns past N zero. A panel's
 * K x PANEL values are one contiguous stream, read in order.
 *
 * Microkernel: a tile of up to MR rows by one panel (PANEL = 32 columns = two 16-lane vectors) in
 * 2 x MR vector accumulators; per k, the panel's two vectors are loaded once and each row's
 * x[m, k] is broadcast and multiplied into both (fused multiply-add). Rows are split into tiles of
 * nearly equal size (33 rows: 7, 7, 7, 6, 6), so no tile is a lone row that rereads the panel.
 *
 * Every output element is one chain over k = 0 .. K-1 from zero, then + bias: the same operations
 * whatever the tile or the thread that computes it, so the result does not depend on the split.
 *
 * Threads: a call's panels go in units of per_unit panels to the helper threads (cpu_threads.h)
 * beside the caller.
 *
 * Built by pdserve_kernels/gemm_cpu.py with the system compiler; plain C99 plus GCC/Clang vector
 * extensions (no torch headers).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_threads.h"

#define PANEL 32
#ifndef MR
#define MR 8 /* rows per tile: 2 x MR accumulators, plus the panel's two vectors, in 32 registers */
#endif

typedef float v16f __attribute__((vector_size(64)));

typedef struct {
    const float *x, *wp, *bias;
    float *out;
    int64_t M, K, N, per_unit, panels;
} job_t;

/* out rows [m0, m0 + mr) x panel columns [n0, n0 + nc) (nc <= PANEL); w: the panel [K][PANEL].
 * Inlined per constant mr, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const job_t *jb, const float *w, const float *pf, int64_t m0,
                                                       int mr, int64_t n0, int64_t nc) {
    const int64_t K = jb->K, N = jb->N;
    const float *x = jb->x + m0 * K;
    v16f acc[MR][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = (v16f){0};
    for (int64_t k = 0; k < K; k++) {
        v16f w0, w1;
        memcpy(&w0, w + k * PANEL, sizeof w0);
        memcpy(&w1, w + k * PANEL + 16, sizeof w1);
        __builtin_prefetch(pf + k * PANEL, 0, 2);
        __builtin_prefetch(pf + k * PANEL + 16, 0, 2);
        for (int m = 0; m < mr; m++) {
            const float a = x[m * K + k];
            acc[m][0] += a * w0;
            acc[m][1] += a * w1;
        }
    }
    v16f b0 = {0}, b1 = {0};
    if (jb->bias != NULL) {
        float bb[PANEL] = {0};
        memcpy(bb, jb->bias + n0, sizeof(float) * (size_t)nc);
        memcpy(&b0, bb, sizeof b0);
        memcpy(&b1, bb + 16, sizeof b1);
    }
    float row[PANEL];
    for (int m = 0; m < mr; m++) {
        float *o = jb->out + (m0 + m) * N + n0;
        if (jb->bias != NULL) acc[m][0] += b0, acc[m][1] += b1;
        if (nc == PANEL) {
            memcpy(o, &acc[m][0], sizeof acc[m][0]);
            memcpy(o + 16, &acc[m][1], sizeof acc[m][1]);
        } else {
            memcpy(row, &acc[m][0], sizeof acc[m][0]);
            memcpy(row + 16, &acc[m][1], sizeof acc[m][1]);
            memcpy(o, row, sizeof(float) * (size_t)nc);
        }
    }
}

/* One tile of mr (1..MR) rows: a constant mr per case, so each inlines with its own registers */
static void tile_rows(const job_t *jb, const float *w, const float *pf, int64_t m0, int mr, int64_t n0,
                      int64_t nc) {
    switch (mr) {
#define CASE(r) case r: tile(jb, w, pf, m0, r, n0, nc); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#if MR > 8
        CASE(9) CASE(10) CASE(11) CASE(12)
#endif
#undef CASE
        default: break;
    }
}

/* Panels [p0, p1): every row tile of each panel, so the panel is read from memory once */
static void gemm_panels(const job_t *jb, int64_t p0, int64_t p1) {
    const int64_t M = jb->M, tiles = (M + MR - 1) / MR;
    for (int64_t p = p0; p < p1; p++) {
        const float *w = jb->wp + p * jb->K * PANEL;
        int64_t n0 = p * PANEL, nc = jb->N - n0 < PANEL ? jb->N - n0 : PANEL;
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {
            int64_t mr = (M - m0) / (tiles - t); /* near-equal tiles: the larger ones first */
            mr += (M - m0) % (tiles - t) != 0;
            /* the first tile streams the panel in; it prefetches the next panel meanwhile */
            const float *pf = t == 0 && p + 1 < p1 ? w + jb->K * PANEL : w;
            tile_rows(jb, w, pf, m0, (int)mr, n0, nc);
            m0 += mr;
        }
    }
}

static void gemm_unit(const void *arg, int64_t i, void *scratch) {
    (void)scratch;
    const job_t *jb = arg;
    int64_t p0 = i * jb->per_unit, p1 = p0 + jb->per_unit;
    gemm_panels(jb, p0, p1 < jb->panels ? p1 : jb->panels);
}

/* x [M, K], out [M, N] contiguous; wp [ceil(N / PANEL), K, PANEL] packed as above; bias [N] or NULL.
 * threads > 1: helper threads take units of per_unit panels beside the caller (the same bits). */
void pdserve_gemm_f32(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                      float *out, int64_t threads, int64_t per_unit) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (per_unit < 1) per_unit = 1;
    job_t jb = {x, wp, bias, out, M, K, N, per_unit, panels};
    int64_t units = (panels + per_unit - 1) / per_unit;
    if (threads <= 1 || units < 2)
        gemm_panels(&jb, 0, panels);
    else
        cpu_threads_run(gemm_unit, &jb, units, 0, NULL, threads);
}

int pdserve_gemm_panel(void) { return PANEL; }
