/* Element-wise ops of a decode step fused into one pass each, float32, single-threaded: the residual
 * add + RMSNorm, the rotary embedding (neox halves and interleaved pairs), SiLU(gate) * up.
 *
 * Legend: T rows (tokens), H heads, X normalised width, D head dim, R rotary dim (<= D), F = R / 2,
 * I intermediate size. Row strides are in floats; the last dimension is always contiguous.
 *
 * Why: at decode sizes (a few to 64 rows of 64..2752 floats) each torch op costs its dispatch and an
 * allocation more than its arithmetic; one C call per op does the arithmetic alone.
 *
 * Numerics follow the torch twins (pdserve_kernels/fused_cpu.py): the same products and sums in the
 * same order, compiled without FMA contraction (-ffp-contract=off), so the rotation and the
 * residual sum are bit-identical to torch's; RMSNorm's sum of squares runs in float32 in another
 * order than torch's, and SiLU's exp is a polynomial within ~2 ulp of expf.
 *
 * Built by pdserve_kernels/fused_cpu.py with the system compiler; plain C99 plus GCC/Clang vector
 * extensions (no torch headers).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define W 16 /* lanes of a v16f: one AVX-512 register, two AVX2 ones */
typedef float v16f __attribute__((vector_size(4 * W)));
typedef int32_t v16i __attribute__((vector_size(4 * W)));

static inline v16f load(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline v16f splat(float x) { return (v16f){0} + x; }

/* a * b + c, fused where the CPU has FMA. Explicit, so it survives -ffp-contract=off: only exp's
 * polynomial uses it (no twin to match there, and it halves the polynomial's instructions). */
static inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    return a * b + c;
#endif
}

/* 1 / d within 1 ulp: the 14-bit estimate and one Newton step where AVX-512 has it (a division
 * costs several times more), else the division. */
static inline v16f recip16(v16f d) {
#if defined(__AVX512F__)
    __m512 r = _mm512_rcp14_ps((__m512)d);
    __m512 e = _mm512_fnmadd_ps((__m512)d, r, _mm512_set1_ps(1.f)); /* 1 - d r */
    __m512 y = _mm512_fmadd_ps(r, e, r);                            /* r + r (1 - d r) */
    /* d = inf: the estimate is 0 and the step's inf * 0 a NaN; 1 / inf is 0 */
    return (v16f)_mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_EQ_OQ), r);
#else
    return splat(1.f) / d;
#endif
}

static inline float hsum(v16f v) {
    float s = 0.f;
    for (int i = 0; i < W; i++) s += v[i];
    return s;
}

/* ------------------------------------------------------------------ RMSNorm */

/* One row: s = x (+ r, written to sum when given); out = (s * rsqrt(mean(s^2) + eps)) * w, torch's
 * order of the two products. */
static void norm_row(const float *restrict x, const float *restrict r, float *restrict sum,
                     const float *restrict w, int64_t X, float eps, float *restrict out) {
    v16f acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    const float *s = r ? sum : x;
    for (; i + 2 * W <= X; i += 2 * W) {
        v16f a = load(x + i), b = load(x + i + W);
        if (r) {
            a += load(r + i);
            b += load(r + i + W);
            store(sum + i, a);
            store(sum + i + W, b);
        }
        acc0 += a * a;
        acc1 += b * b;
    }
    float ss = hsum(acc0 + acc1);
    for (; i < X; i++) {
        float a = x[i];
        if (r) {
            a += r[i];
            sum[i] = a;
        }
        ss += a * a;
    }
    float inv = 1.f / sqrtf(ss / (float)X + eps);
    v16f vinv = splat(inv);
    for (i = 0; i + W <= X; i += W) store(out + i, (load(s + i) * vinv) * load(w + i));
    for (; i < X; i++) out[i] = (s[i] * inv) * w[i];
}

/* x [A, B, X] at strides (sa, sb, 1), residual likewise at (ra, rb, 1) or NULL; out and sum are
 * contiguous [A, B, X]. sum gets x + residual (the next residual stream); out the normed rows. */
void pdserve_rmsnorm_f32(const float *x, int64_t A, int64_t B, int64_t X, int64_t sa, int64_t sb,
                         const float *residual, int64_t ra, int64_t rb, const float *w, float eps,
                         float *out, float *sum) {
    for (int64_t a = 0; a < A; a++)
        for (int64_t b = 0; b < B; b++) {
            int64_t row = (a * B + b) * X;
            norm_row(x + a * sa + b * sb, residual ? residual + a * ra + b * rb : NULL,
                     residual ? sum + row : NULL, w, X, eps, out + row);
        }
}

/* ------------------------------------------------------------------ rotary */

/* x [T, H, D] at strides (st, sh, 1) -> out [T, H, D] contiguous, the first R dims of each head
 * rotated by row t's cos / sin [F] (at row strides sc, ss), the rest copied.
 * neox: pairs (x[f], x[f + F]) -> out[f] = x1 cos - x2 sin, out[f + F] = x2 cos + x1 sin.
 * interleaved: pairs (x[2f], x[2f + 1]), written de-interleaved as neox's (the twin's layout). */
void pdserve_rotary_f32(const float *x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh,
                        const float *cos, int64_t sc, const float *sin, int64_t ss, int64_t R,
                        int interleaved, float *out) {
    int64_t F = R / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *restrict c = cos + t * sc, *restrict s = sin + t * ss;
        for (int64_t h = 0; h < H; h++) {
            const float *restrict xi = x + t * st + h * sh;
            float *restrict o = out + (t * H + h) * D;
            if (interleaved) {
                for (int64_t f = 0; f < F; f++) {
                    float x1 = xi[2 * f], x2 = xi[2 * f + 1];
                    o[f] = x1 * c[f] - x2 * s[f];
                    o[f + F] = x2 * c[f] + x1 * s[f];
                }
            } else {
                for (int64_t f = 0; f < F; f++) {
                    float x1 = xi[f], x2 = xi[f + F];
                    o[f] = x1 * c[f] - x2 * s[f];
                    o[f + F] = x2 * c[f] + x1 * s[f];
                }
            }
            if (R < D) memcpy(o + R, xi + R, (size_t)(D - R) * sizeof(float));
        }
    }
}

/* q [T, Hq, Dq] and k [T, Hk, Dk] rotated by the same rows of cos / sin in one call (MLA's q_pe and
 * k_pe live in different projections): pdserve_rotary_f32 on each. */
void pdserve_rotary_pair_f32(const float *q, int64_t Hq, int64_t Dq, int64_t sqt, int64_t sqh, float *qo,
                             const float *k, int64_t Hk, int64_t Dk, int64_t skt, int64_t skh, float *ko,
                             int64_t T, const float *cos, int64_t sc, const float *sin, int64_t ss, int64_t R,
                             int interleaved) {
    pdserve_rotary_f32(q, T, Hq, Dq, sqt, sqh, cos, sc, sin, ss, R, interleaved, qo);
    pdserve_rotary_f32(k, T, Hk, Dk, skt, skh, cos, sc, sin, ss, R, interleaved, ko);
}

/* ------------------------------------------------------------------ SiLU x mul */

/* exp(x) for 16 lanes, Cephes' expf: x = n ln2 + r (ln2 in two parts, n = round(x log2 e)), a
 * degree-6 polynomial in r, times 2^n. Overflow gives +inf, underflow 0, NaN stays NaN. */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f /* 9 bits: n * LN2_HI is exact */
#define LN2_LO (-2.12194440e-4f)

static inline v16f exp_poly(v16f r) {
    v16f p = splat(1.9875691500e-4f);
    p = fma16(p, r, splat(1.3981999507e-3f));
    p = fma16(p, r, splat(8.3334519073e-3f));
    p = fma16(p, r, splat(4.1665795894e-2f));
    p = fma16(p, r, splat(1.6666665459e-1f));
    p = fma16(p, r, splat(5.0000001201e-1f));
    return fma16(p, r * r, r + splat(1.f));
}

#if defined(__AVX512F__)
static inline v16f exp16(v16f x) {
    /* clamped where exp is already 0 or inf, so n stays finite (scalef then rounds to 0 or inf) */
    __m512 xc = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 y = _mm512_scalef_ps((__m512)exp_poly((v16f)r), n);
    return (v16f)_mm512_mask_mov_ps(y, _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q), (__m512)x);
}
#else
static inline v16f exp16(v16f x) {
    const v16f hi = splat(88.7228391f), lo = splat(-87.3365448f);
    v16i over = x > hi, under = x < lo;
    v16f xc = (v16f)(((v16i)x & ~(over | under)) | ((v16i)hi & over) | ((v16i)lo & under));
    v16f fx = xc * splat(LOG2E) + splat(0.5f);
    v16i n = __builtin_convertvector(fx, v16i);
    v16f nf = __builtin_convertvector(n, v16f);
    n += (v16i)(nf > fx); /* floor (a true lane is -1): the conversion truncates toward zero */
    nf = __builtin_convertvector(n, v16f);
    v16f p = exp_poly(xc - nf * splat(LN2_HI) - nf * splat(LN2_LO));
    v16i top = n > 127; /* 2^128 has no float: 2p * 2^127 instead (p + p is exact) */
    n += top;
    p += (v16f)((v16i)p & top);
    v16f y = p * (v16f)((n + 127) << 23);
    const v16f inf = splat(INFINITY);
    y = (v16f)(((v16i)y & ~over) | ((v16i)inf & over));
    return (v16f)(((v16i)y & ~under) | ((v16i)splat(0.f) & under));
}
#endif

/* x [T, 2I] at row stride sx ([gate | up]) -> out [T, I] contiguous: gate / (1 + exp(-gate)) * up,
 * torch's silu then mul (the division as gate times a reciprocal within 1 ulp). */
void pdserve_silu_mul_f32(const float *x, int64_t T, int64_t I, int64_t sx, float *out) {
    const v16f one = splat(1.f);
    for (int64_t t = 0; t < T; t++) {
        const float *restrict g = x + t * sx, *restrict u = g + I;
        float *restrict o = out + t * I;
        int64_t i = 0;
        for (; i + W <= I; i += W) {
            v16f a = load(g + i);
            store(o + i, a * recip16(one + exp16(-a)) * load(u + i));
        }
        if (i < I) { /* the tail through a padded vector: the same exp as the body's */
            float ga[W] = {0}, ua[W] = {0}, oa[W];
            memcpy(ga, g + i, (size_t)(I - i) * sizeof(float));
            memcpy(ua, u + i, (size_t)(I - i) * sizeof(float));
            v16f a = load(ga);
            store(oa, a * recip16(one + exp16(-a)) * load(ua));
            memcpy(o + i, oa, (size_t)(I - i) * sizeof(float));
        }
    }
}

/* SiLU x mul in units of per_unit rows on the helper threads of cpu_threads.h (up to threads in all):
 * each row is computed as pdserve_silu_mul_f32 computes it, so the result is the same bits for any
 * thread count. For prefill's calls (hundreds of rows of thousands of floats), where one thread
 * alone leaves the forward's other cores idle. */
#include "cpu_threads.h"

typedef struct {
    const float *x;
    float *out;
    int64_t T, I, sx, per_unit;
} silu_job_t;

static void silu_unit(const void *arg, int64_t u, void *scratch) {
    (void)scratch;
    const silu_job_t *jb = arg;
    const int64_t t0 = u * jb->per_unit, n = jb->T - t0 < jb->per_unit ? jb->T - t0 : jb->per_unit;
    pdserve_silu_mul_f32(jb->x + t0 * jb->sx, n, jb->I, jb->sx, jb->out + t0 * jb->I);
}

void pdserve_silu_mul_threads_f32(const float *x, int64_t T, int64_t I, int64_t sx, float *out, int64_t threads,
                                  int64_t per_unit) {
    if (per_unit < 1) per_unit = 1;
    silu_job_t jb = {x, out, T, I, sx, per_unit};
    cpu_threads_run(silu_unit, &jb, (T + per_unit - 1) / per_unit, 0, NULL, threads);
}
