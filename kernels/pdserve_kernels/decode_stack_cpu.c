/* A float32 Llama-shaped GQA decode step's decoder layers in one call (one new token per request):
 * per layer
 *   [residual add +] RMSNorm -> qkv GEMM (+ bias) -> rotary on q and k -> k and v into the layer's
 *   pool at out_cache_loc[b] -> decode attention by slot -> o GEMM (+ bias) -> residual add + RMSNorm
 *   -> gate_up GEMM -> SiLU x mul -> down GEMM,
 * returning the last layer's hidden and residual (the caller applies the final norm).
 *
 * Legend: B requests (rows), H hidden, Hq / Hkv query / KV heads, G = Hq / Hkv, D head dim,
 * R rotary dim (<= D), F = R / 2, I intermediate size, Wqkv = (Hq + 2 Hkv) D, L kv_slots' width,
 * P pages, S page size, N = P S pool slots.
 *
 * Why: a decode step of a small model is mostly per-op overhead (Python, ctypes, torch dispatch,
 * helper wake-ups, pool writes through index_put); the arithmetic alone is a fraction of it.
 *
 * Not a copy of the kernels it runs: it includes them (gemm_cpu.c, decode_attention_cpu.c,
 * fused_cpu.c), so each phase is the same code, in the same order of operations, as the layer-by-layer
 * C path; this library has ONE helper pool (cpu_threads.h), and every parallel phase (a GEMM's
 * panels, attention's request groups) is one cpu_threads_run on it. The row-wise phases (norms,
 * rotary, KV write, SiLU) are microseconds each and run on the caller.
 *
 * fused_cpu.c is compiled without FMA contraction, as its own library is (its products and sums
 * round as torch's separate ops do); the GEMM and attention keep the default contraction, as theirs.
 *
 * Built by pdserve_kernels/decode_stack_cpu.py with the system compiler; plain C99 plus GCC/Clang
 * vector extensions (no torch headers).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* job_t names each kernel's own job: renamed per include so the three live in one file */
#define job_t gemm_job_t
#include "gemm_cpu.c"
#undef job_t

#define job_t attention_job_t
#include "decode_attention_cpu.c"
#undef job_t

#if defined(__clang__)
#pragma clang fp contract(off)
#include "fused_cpu.c"
#pragma clang fp contract(on)
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#include "fused_cpu.c"
#pragma GCC pop_options
#endif

/* What every layer shares, and the thread policies of the layer-by-layer path's wrappers */
typedef struct {
    int64_t layers, H, Hq, Hkv, D, I, R;
    int64_t interleaved;
    int64_t P, S, k_page, k_head, k_token, v_page, v_head, v_token; /* pool geometry, strides in floats */
    double scale;
    int64_t gemm_min_work;     /* a GEMM shares its panels from M x N x K multiply-adds (gemm_cpu.py) */
    int64_t units_per_thread;  /* a GEMM's panel units per thread */
} stack_dims_t;

/* One layer's weights (GEMM weights packed into panels [ceil(N / PANEL), K, PANEL]; biases or NULL)
 * and its pool buffers [P, Hkv, S, D] */
typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    double input_eps, post_eps;
    const float *qkv, *qkv_bias;         /* N = Wqkv */
    const float *o, *o_bias;             /* N = H, K = Hq D */
    const float *gate_up, *down;         /* N = 2I, K = H; N = H, K = I */
    float *k_cache, *v_cache;
} stack_layer_t;

/* Floats of work space a call of B rows needs (the Python side allocates it) */
int64_t pdserve_decode_stack_work_floats(const stack_dims_t *d, int64_t B) {
    const int64_t Wqkv = (d->Hq + 2 * d->Hkv) * d->D;
    return B * (2 * d->H + Wqkv + 2 * d->Hq * d->D + 3 * d->I) + scratch_floats(d->Hq / d->Hkv, d->Hq);
}

/* out [M, N] = x [M, K] @ W^T (+ bias), gemm_cpu.py's thread policy */
static void gemm(const stack_dims_t *d, const float *x, int64_t M, int64_t K, const float *wp, int64_t N,
                 const float *bias, float *out, int64_t threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (threads > 1 && M * N * K < d->gemm_min_work) threads = 1;
    int64_t per_unit = threads > 1 ? panels / (threads * d->units_per_thread) : panels;
    pdserve_gemm_f32(x, M, K, wp, N, bias, out, threads, per_unit < 1 ? 1 : per_unit);
}

/* q rotated into q_out [B, Hq, D]; k rotated and v copied into the pool rows of slot out_cache_loc[b] */
static void rotate_and_write(const stack_dims_t *d, const stack_layer_t *ly, const float *qkv, int64_t B,
                             const float *cos, int64_t sc, const float *sin, int64_t ss, const int64_t *loc,
                             float *q_out) {
    const int64_t Hq = d->Hq, Hkv = d->Hkv, D = d->D, Wqkv = (Hq + 2 * Hkv) * D;
    const int il = (int)d->interleaved;
    pdserve_rotary_f32(qkv, B, Hq, D, Wqkv, D, cos, sc, sin, ss, d->R, il, q_out);
    for (int64_t b = 0; b < B; b++) {
        const int64_t page = loc[b] / d->S, off = loc[b] % d->S;
        const float *k = qkv + b * Wqkv + Hq * D, *v = k + Hkv * D;
        for (int64_t h = 0; h < Hkv; h++) {
            float *kr = ly->k_cache + page * d->k_page + h * d->k_head + off * d->k_token;
            float *vr = ly->v_cache + page * d->v_page + h * d->v_head + off * d->v_token;
            pdserve_rotary_f32(k + h * D, 1, 1, D, 0, 0, cos + b * sc, 0, sin + b * ss, 0, d->R, il, kr);
            memcpy(vr, v + h * D, sizeof(float) * (size_t)D);
        }
    }
}

/* Work space of a call, carved from one buffer (pdserve_decode_stack_work_floats) */
typedef struct {
    float *xn, *res, *qkv, *q, *attn, *gu, *act, *sc;
} work_t;

static work_t carve(const stack_dims_t *d, int64_t B, float *w) {
    const int64_t H = d->H, QD = d->Hq * d->D, Wqkv = (d->Hq + 2 * d->Hkv) * d->D, I = d->I;
    work_t t;
    t.xn = w, w += B * H;
    t.res = w, w += B * H;
    t.qkv = w, w += B * Wqkv;
    t.q = w, w += B * QD;
    t.attn = w, w += B * QD;
    t.gu = w, w += B * 2 * I;
    t.act = w, w += B * I;
    t.sc = w;
    return t;
}

/* Every layer over B rows. hidden [B, H]: the embedded tokens (read only); out [B, H]: the last
 * layer's hidden; residual [B, H]: its residual stream. Rows and slots as decode attention's
 * (kv_slots [B, L] at row stride slot_stride, seq_lens [B]); loc [B]: each row's new slot, which
 * its attention reads (kv_slots[b, seq_lens[b] - 1] by the forward batch's invariant). cos / sin:
 * row b's F angles at row strides sc / ss. Lengths, slots and new slots are checked before any
 * write: BAD_LEN, BAD_SLOT (then nothing is written). attn_threads / attn_per_unit: the attention's
 * split (decode_attention_cpu.py's policy); threads: the GEMMs'. */
int pdserve_decode_stack_f32(const stack_dims_t *d, const stack_layer_t *layers, const float *hidden, int64_t B,
                             const float *cos, int64_t sc, const float *sin, int64_t ss, const int64_t *loc,
                             const int64_t *kv_slots, int64_t L, int64_t slot_stride, const int64_t *seq_lens,
                             float *out, float *residual, float *work, int64_t threads, int64_t attn_threads,
                             int64_t attn_per_unit) {
    const int64_t N = d->P * d->S, H = d->H, QD = d->Hq * d->D, I = d->I, Wqkv = (d->Hq + 2 * d->Hkv) * d->D;
    int rc = check_requests(B, kv_slots, L, slot_stride, seq_lens, N);
    if (rc != OK) return rc;
    for (int64_t b = 0; b < B; b++)
        if (loc[b] < 0 || loc[b] >= N) return BAD_SLOT;
    work_t w = carve(d, B, work);
    /* the residual stream alternates between two buffers: the add's inputs and output never alias */
    float *bufs[2] = {residual, w.res};
    int next = 0;
    const float *x = hidden, *res = NULL;
    for (int64_t i = 0; i < d->layers; i++) {
        const stack_layer_t *ly = layers + i;
        float *sum = res == NULL ? NULL : bufs[next];
        pdserve_rmsnorm_f32(x, B, 1, H, H, 0, res, H, 0, ly->input_norm, (float)ly->input_eps, w.xn, sum);
        if (res == NULL)
            res = hidden; /* the first layer: the embedded tokens are the residual */
        else
            res = sum, next ^= 1;
        gemm(d, w.xn, B, H, ly->qkv, Wqkv, ly->qkv_bias, w.qkv, threads);
        rotate_and_write(d, ly, w.qkv, B, cos, sc, sin, ss, loc, w.q);
        pool_t c = pool_of(ly->k_cache, ly->v_cache, d->S, d->k_page, d->k_head, d->k_token, d->v_page, d->v_head,
                           d->v_token, d->D, d->D, d->Hq / d->Hkv, (float)d->scale);
        attend(&c, w.q, w.attn, kv_slots, slot_stride, seq_lens, B, d->Hq, d->Hkv, w.sc, attn_threads, attn_per_unit);
        gemm(d, w.attn, B, QD, ly->o, H, ly->o_bias, out, threads);
        sum = bufs[next];
        pdserve_rmsnorm_f32(out, B, 1, H, H, 0, res, H, 0, ly->post_norm, (float)ly->post_eps, w.xn, sum);
        res = sum, next ^= 1;
        gemm(d, w.xn, B, H, ly->gate_up, 2 * I, NULL, w.gu, threads);
        pdserve_silu_mul_f32(w.gu, B, I, 2 * I, w.act);
        gemm(d, w.act, B, I, ly->down, H, NULL, out, threads);
        x = out;
    }
    if (res != NULL && res != residual) memcpy(residual, res, sizeof(float) * (size_t)(B * H));
    return OK;
}
