/* Vector helpers shared by the plain-C CPU kernels (GCC/Clang vector extensions, no intrinsics).
 *
 * dot4: four dot products against one vector, four accumulator chains in flight, then one
 * fixed-order reduction (sum4). The order of every multiply and add is fixed, so equal inputs
 * give equal bits wherever it is called (the indexer's ties depend on that).
 */
#ifndef PDSERVE_CPU_SIMD_H
#define PDSERVE_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));

/* Four 8-lane partial sums -> their four sums, reduced together (pairwise, a fixed order) */
static inline v4f sum4(v8f a, v8f b, v8f c, v8f d) {
    v8f x = __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15); /* a01 b01 a23 b23 a45 b45 a67 b67 */
    v8f y = __builtin_shufflevector(c, d, 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(c, d, 1, 9, 3, 11, 5, 13, 7, 15);
    v8f z = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
            __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15); /* a0-3 b0-3 c0-3 d0-3 a4-7 .. d4-7 */
    return __builtin_shufflevector(z, z, 0, 1, 2, 3) + __builtin_shufflevector(z, z, 4, 5, 6, 7);
}

/* {x . r0, x . r1, x . r2, x . r3} over D floats: each row is loaded once, x once per 8 lanes */
static inline v4f dot4(const float *x, const float *r0, const float *r1, const float *r2, const float *r3,
                       int64_t D) {
    const int64_t D8 = D & ~(int64_t)7;
    v8f a = {0}, b = {0}, c = {0}, e = {0};
    for (int64_t d = 0; d < D8; d += 8) {
        v8f v, y0, y1, y2, y3;
        memcpy(&v, x + d, sizeof v);
        memcpy(&y0, r0 + d, sizeof v);
        memcpy(&y1, r1 + d, sizeof v);
        memcpy(&y2, r2 + d, sizeof v);
        memcpy(&y3, r3 + d, sizeof v);
        a += v * y0;
        b += v * y1;
        c += v * y2;
        e += v * y3;
    }
    v4f s = sum4(a, b, c, e);
    for (int64_t d = D8; d < D; d++) {
        v4f t = {r0[d], r1[d], r2[d], r3[d]};
        s += x[d] * t;
    }
    return s;
}

#endif
