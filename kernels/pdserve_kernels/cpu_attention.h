/* Attention pieces shared by the plain-C CPU attention kernels (decode_attention_cpu.c,
 * extend_attention_cpu.c): dot products and scaled scores, an exp for shifted scores, online
 * softmax's row rescale and the values' accumulation. Float accumulation in a fixed order, so a
 * row's result does not depend on which kernel or thread computes it.
 */
#ifndef PDSERVE_CPU_ATTENTION_H
#define PDSERVE_CPU_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* log2(S) where the page size S is a power of two, else -1 (then slot_page divides) */
static inline int page_shift(int64_t S) {
    int shift = -1;
    if ((S & (S - 1)) == 0)
        for (shift = 0; ((int64_t)1 << shift) < S; shift++) {}
    return shift;
}

/* Slot s is row *off of page *page: a shift and a mask for a power-of-two page size (a 64-bit
 * division per slot and head cost as much as the attention's arithmetic) */
static inline void slot_page(int64_t s, int shift, int64_t S, int64_t *page, int64_t *off) {
    if (shift >= 0)
        *page = s >> shift, *off = s & (S - 1);
    else
        *page = s / S, *off = s % S;
}

/* q . k over D floats: two 16-lane partial sums (two chains in flight), then a fixed tree */
static inline float dot(const float *q, const float *k, int64_t D) {
    v16f a = {0}, b = {0};
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        v16f x0, y0, x1, y1;
        memcpy(&x0, q + d, sizeof x0);
        memcpy(&y0, k + d, sizeof y0);
        memcpy(&x1, q + d + 16, sizeof x1);
        memcpy(&y1, k + d + 16, sizeof y1);
        a += x0 * y0;
        b += x1 * y1;
    }
    for (; d + 16 <= D; d += 16) {
        v16f x, y;
        memcpy(&x, q + d, sizeof x);
        memcpy(&y, k + d, sizeof y);
        a += x * y;
    }
    a += b;
    v8f h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    float s = ((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7]));
    for (; d < D; d++) s += q[d] * k[d];
    return s;
}

/* out[j] = scale * q . kr[j] for j < nb: four keys at a time (four chains in flight, one reduction) */
static void scores(const float *q, const float *const *kr, int64_t nb, int64_t D, float scale, float *out) {
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) {
        v4f s4 = dot4(q, kr[j], kr[j + 1], kr[j + 2], kr[j + 3], D);
        s4 *= scale;
        memcpy(out + j, &s4, sizeof s4);
    }
    for (; j < nb; j++) out[j] = scale * dot(q, kr[j], D);
}

/* exp(x) for 16 lanes of x <= 0 (scores minus their running max), relative error about 1e-7:
 * x log2(e) = n + f with |f| <= 1/2, 2^f by its degree-6 series, 2^n into the exponent bits.
 * Lanes below -87 (where exp is under 2^-125, nothing beside the max's 1) give about 2^-125. */
static inline v16f vexp(v16f x) {
    const v16f zero = {0}, lo = zero - 87.0f;
    v16i below = x < lo;
    x = (v16f)(((v16i)x & ~below) | ((v16i)lo & below));
    v16f t = x * 1.44269504088896341f;
    const v16f magic = zero + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v16f r = t + magic;
    v16f n = r - magic;
    v16f f = (t - n) * 0.693147180559945309f;
    v16f p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    v16u e = ((v16u)r - 0x4B400000u) << 23;
    return (v16f)((v16u)p + e);
}

/* p[j] = exp(p[j] - m) for j < n; returns their sum */
static float exp_shifted(float *p, int64_t n, float m) {
    float sum = 0.0f;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        v16f x;
        memcpy(&x, p + j, sizeof x);
        x = vexp(x - m);
        memcpy(p + j, &x, sizeof x);
    }
    for (; j < n; j++) p[j] = expf(p[j] - m);
    for (int64_t i = 0; i < n; i++) sum += p[i];
    return sum;
}

static inline void scale_row(float *restrict o, float a, int64_t D) {
    for (int64_t d = 0; d < D; d++) o[d] *= a;
}

/* o[g] += sum_j p[g][j] v_j over nb value rows, p's rows ps apart: 16 columns of one head at a time in a register,
 * so each value row is loaded once per head and the output once per block */
static void accumulate_values(const float *const *vr, int64_t nb, const float *p, int64_t ps, float *o,
                                     int64_t G, int64_t Dv) {
    int64_t d = 0;
    for (; d + 16 <= Dv; d += 16) {
        for (int64_t g = 0; g < G; g++) {
            const float *pg = p + g * ps;
            v16f acc, a[4] = {{0}, {0}, {0}, {0}};  /* four chains in flight, not one long one */
            memcpy(&acc, o + g * Dv + d, sizeof acc);
            int64_t j = 0;
            for (; j + 4 <= nb; j += 4)
                for (int u = 0; u < 4; u++) {
                    v16f x;
                    memcpy(&x, vr[j + u] + d, sizeof x);
                    a[u] += pg[j + u] * x;
                }
            for (; j < nb; j++) {
                v16f x;
                memcpy(&x, vr[j] + d, sizeof x);
                a[0] += pg[j] * x;
            }
            acc += (a[0] + a[1]) + (a[2] + a[3]);
            memcpy(o + g * Dv + d, &acc, sizeof acc);
        }
    }
    for (; d < Dv; d++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < nb; j++) o[g * Dv + d] += p[g * ps + j] * vr[j][d];
}

#endif
