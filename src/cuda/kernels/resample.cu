// Bilinear resize of an f32 plane (a mask or an alpha) as fast_image_resize does it for
// PIL mode "F" (src/stages/resample.rs), in f32: its coefficients, computed in f64 on
// the host, are read rounded to f32, and both passes (a horizontal pass over the rows the
// vertical pass needs, then the vertical pass) multiply and add in f32 where the CPU does
// in f64, so that no FP64 unit is needed (1/32 to 1/64 of FP32 on T4, A10G, L4). The
// horizontal sum follows the four-lane order of fast_image_resize's AVX2 code, the
// vertical one its sequential order. Against the CPU: each pass's n taps add at most
// n + 1 f32 roundings (the coefficient, the product, the sums) relative to the sum of
// |sample x coefficient|, so a plane in [0, 1] differs by a few 2^-24 at most, far below
// an 8-bit step (tests/cuda_gpu.rs, `plane_resize_is_held_to_the_cpu`, states the bound).
#include "common.cuh"

// Horizontal pass over source rows [row0, row0 + rows): `dst` is dst_w x rows.
extern "C" __global__ void resize_plane_horizontal(
    const float* src, u32 src_w, u32 row0, u32 rows, const u32* first, const u32* count,
    const float* coeffs, u32 window, float* dst, u32 dst_w) {
    HorizontalCell c;
    if (!horizontal_cell(dst_w, rows, &c)) return;
    const float* s = src + ((u64)row0 + c.row) * src_w + first[c.x];
    const float* k = coeffs + (u64)c.x * window;
    u32 n = count[c.x];
    // Lane j of the AVX2 accumulator takes taps j, j + 4, j + 8, ... in order.
    float l0 = 0.0f, l1 = 0.0f, l2 = 0.0f, l3 = 0.0f;
    u32 t = 0;
    for (; t + 8u <= n; t += 8u) {
        l0 = l0 + s[t] * k[t];
        l1 = l1 + s[t + 1] * k[t + 1];
        l2 = l2 + s[t + 2] * k[t + 2];
        l3 = l3 + s[t + 3] * k[t + 3];
        l0 = l0 + s[t + 4] * k[t + 4];
        l1 = l1 + s[t + 5] * k[t + 5];
        l2 = l2 + s[t + 6] * k[t + 6];
        l3 = l3 + s[t + 7] * k[t + 7];
    }
    if (t + 4u <= n) {
        l0 = l0 + s[t] * k[t];
        l1 = l1 + s[t + 1] * k[t + 1];
        l2 = l2 + s[t + 2] * k[t + 2];
        l3 = l3 + s[t + 3] * k[t + 3];
        t += 4u;
    }
    if (t + 2u <= n) {
        l0 = l0 + s[t] * k[t];
        l1 = l1 + s[t + 1] * k[t + 1];
        t += 2u;
    }
    if (t < n) {
        l0 = l0 + s[t] * k[t];
    }
    dst[c.i] = (l0 + l2) + (l1 + l3);
}

// Vertical pass: `src` (w wide) starts at source row `src_row0`; `dst` is w x dst_h.
extern "C" __global__ void resize_plane_vertical(
    const float* src, u32 w, u32 src_row0,
    const u32* first, const u32* count, const float* coeffs, u32 window,
    float* dst, u32 dst_h) {
    u64 i = global_index();
    if (i >= (u64)w * dst_h) return;
    u32 x = (u32)(i % w);
    u32 y = (u32)(i / w);
    const float* s = src + (u64)(first[y] - src_row0) * w + x;
    const float* k = coeffs + (u64)y * window;
    u32 n = count[y];
    float sum = 0.0f;
    for (u32 t = 0; t < n; ++t) {
        sum = sum + s[(u64)t * w] * k[t];
    }
    dst[i] = sum;
}

// IEEE binary16 bits -> f32, exactly (every half is a float), as the half crate's
// f16::to_f32 does it (a NaN gets the quiet bit): an engine's float16 output (a TensorRT 11
// engine of a float16 model) as the f32 plane the trimap and matting kernels read.
extern "C" __global__ void f16_to_f32(const u16* src, u32 n, float* dst) {
    u64 i = global_index();
    if (i >= n) return;
    u32 h = (u32)src[i];
    u32 sign = (h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    u32 bits;
    if (exp == 0x1fu) {
        // Infinity; NaN with its payload and the quiet bit.
        bits = sign | (man == 0u ? 0x7f800000u : (0x7fc00000u | (man << 13)));
    } else if (exp != 0u) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
    } else if (man == 0u) {
        bits = sign;  // zero
    } else {
        // Subnormal: m x 2^-24; shift the leading one up to bit 10, one exponent each.
        u32 e = 113u;
        while ((man & 0x400u) == 0u) {
            man <<= 1;
            e -= 1u;
        }
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
    dst[i] = __uint_as_float(bits);
}
