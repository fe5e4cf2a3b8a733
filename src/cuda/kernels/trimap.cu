// Trimap: the segmentation output -> background (0) / unknown (128) / foreground (255) at
// the output's resolution (src/stages/trimap.rs), then the erosion that widens the
// unknown band, then PIL NEAREST to the source size (src/stages/resample.rs). Exact:
// comparisons, min/max and IEEE f32 only.
#include "common.cuh"

// f32 <-> u32 keys whose unsigned order is the float order, for atomicMin/atomicMax.
__device__ __forceinline__ u32 float_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// lohi[0] = key(+inf), lohi[1] = key(-inf): the identities of min and max.
extern "C" __global__ void mask_minmax_init(u32* lohi) {
    if (global_index() == 0) {
        lohi[0] = float_key(__int_as_float(0x7f800000));
        lohi[1] = float_key(__int_as_float(0xff800000));
    }
}

// Min and max of `data[0..n)`, NaNs skipped (Rust's f32::min/max ignore a NaN operand).
extern "C" __global__ void mask_minmax(const float* data, u32 n, u32* lohi) {
    u64 i = global_index();
    u32 lo = float_key(__int_as_float(0x7f800000));
    u32 hi = float_key(__int_as_float(0xff800000));
    if (i < n) {
        float v = data[i];
        if (v == v) {
            lo = float_key(v);
            hi = lo;
        }
    }
    lo = warp_min_u32(lo);
    hi = warp_max_u32(hi);
    if ((threadIdx.x & 31u) == 0u) {
        atomicMin(&lohi[0], lo);
        atomicMax(&lohi[1], hi);
    }
}

// The probability (optionally min-max rescaled, then clamped to [0, 1]) into `coarse`,
// and its three-way threshold into `trimap`.
extern "C" __global__ void probability_trimap(
    const float* data, u32 n, const u32* lohi, int minmax,
    float foreground, float background, float* coarse, u8* trimap) {
    u64 i = global_index();
    if (i >= n) return;
    float v = data[i];
    if (minmax) {
        float lo = key_float(lohi[0]);
        float hi = key_float(lohi[1]);
        if (hi > lo) {
            float span = hi - lo;
            v = (v - lo) / span;
        }
    }
    // Rust's clamp: a NaN stays NaN (and then thresholds to unknown).
    if (v < 0.0f) v = 0.0f;
    if (v > 1.0f) v = 1.0f;
    coarse[i] = v;
    trimap[i] = v >= foreground ? TRIMAP_FOREGROUND
              : (v <= background ? TRIMAP_BACKGROUND : TRIMAP_UNKNOWN);
}

// Argmax over `classes` planes of `plane` scores (ties to the lower class), each class
// mapped to `class_values[c]`; `coarse` = value / 255.
extern "C" __global__ void classes_trimap(
    const float* scores, u32 plane, u32 classes, const u8* class_values,
    float* coarse, u8* trimap) {
    u64 i = global_index();
    if (i >= plane) return;
    u32 best = 0;
    float best_score = scores[i];
    for (u32 c = 1; c < classes; ++c) {
        float v = scores[(u64)c * plane + i];
        if (v > best_score) {
            best_score = v;
            best = c;
        }
    }
    u8 value = class_values[best];
    trimap[i] = value;
    coarse[i] = (float)value / 255.0f;
}

// Erosion, pass 1: bit 0 of `flags` = every pixel of the row window [x-r, x+r] (clipped
// to the image) is foreground, bit 1 = every one is background.
extern "C" __global__ void erode_rows(const u8* trimap, u32 w, u32 h, u32 r, u8* flags) {
    u64 i = global_index();
    if (i >= (u64)w * h) return;
    u32 x = (u32)(i % w);
    const u8* row = trimap + (i - x);
    u32 lo = x > r ? x - r : 0u;
    u32 hi = (u64)x + r < w ? x + r : w - 1u;
    bool all_fg = true, all_bg = true;
    for (u32 k = lo; k <= hi; ++k) {
        u8 v = row[k];
        all_fg = all_fg && v == TRIMAP_FOREGROUND;
        all_bg = all_bg && v == TRIMAP_BACKGROUND;
    }
    flags[i] = (u8)((all_fg ? 1u : 0u) | (all_bg ? 2u : 0u));
}

// Erosion, pass 2: a certain pixel stays certain only if the column window of its row
// flags keeps its bit. In place: each thread writes only its own pixel and reads only
// `flags`.
extern "C" __global__ void erode_columns(u8* trimap, const u8* flags, u32 w, u32 h, u32 r) {
    u64 i = global_index();
    if (i >= (u64)w * h) return;
    u32 x = (u32)(i % w);
    u32 y = (u32)(i / w);
    u32 lo = y > r ? y - r : 0u;
    u32 hi = (u64)y + r < h ? y + r : h - 1u;
    u32 keep = 3u;
    for (u32 k = lo; k <= hi; ++k) {
        keep &= flags[(u64)k * w + x];
    }
    u8 v = trimap[i];
    if ((v == TRIMAP_FOREGROUND && !(keep & 1u)) || (v == TRIMAP_BACKGROUND && !(keep & 2u))) {
        trimap[i] = TRIMAP_UNKNOWN;
    }
}

// PIL NEAREST: `xs`/`ys` are the source index of each destination column/row, computed
// on the host with PIL's running f64 sum.
extern "C" __global__ void resize_nearest_u8(
    const u8* src, u32 src_w, const u32* xs, const u32* ys, u32 dst_w, u32 dst_h, u8* dst) {
    u64 i = global_index();
    if (i >= (u64)dst_w * dst_h) return;
    u32 x = (u32)(i % dst_w);
    u32 y = (u32)(i / dst_w);
    dst[i] = src[(u64)ys[y] * src_w + xs[x]];
}

// A trimap as the matting model's input: value / 255 in f32.
extern "C" __global__ void trimap_to_unit_f32(const u8* trimap, u32 n, float* out) {
    u64 i = global_index();
    if (i >= n) return;
    out[i] = (float)trimap[i] / 255.0f;
}

// The same, for an f16 engine input.
extern "C" __global__ void trimap_to_unit_f16(const u8* trimap, u32 n, u16* out) {
    u64 i = global_index();
    if (i >= n) return;
    out[i] = f32_to_f16_bits((float)trimap[i] / 255.0f);
}
