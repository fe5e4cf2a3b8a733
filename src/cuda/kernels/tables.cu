// The resampling tables a change of image size needs, made on the device from their
// sizes alone (nothing is uploaded): the same arithmetic, in the same order, as the host's
// src/cuda/taps.rs and src/stages/preprocess.rs, so that each table is bit-identical to
// the one the host would compute (tests/device_tables.rs holds them to it). One thread
// per output sample, except the NEAREST indices (a running sum, one thread per axis).
//
// FP64: PIL's and fast_image_resize's taps are computed in f64, and their bits depend on
// it, so these kernels compute in FP64. They run only when a replica's image size changes
// (a handful of threads per table, a few FP64 operations per tap); tests/cuda_nvrtc.rs
// lists them with that reason and docs/gpu.md gives their cost on an FP64-poor GPU.

#include "common.cuh"

// PIL's `precompute_coeffs` for the bilinear (triangle) filter at output sample `xx`
// (preprocess.rs `bilinear_weights`): inputs `xmin..xmax`, their weights before the
// normalisation, and the sum that normalises them.
struct PilRow {
    double center;
    double filter_scale;
    i64 xmin;
    i64 xmax;
    double total;
};

__device__ __forceinline__ double pil_weight(const PilRow* r, i64 x) {
    double t = ((double)x - r->center + 0.5) / r->filter_scale;
    double w = 1.0 - fabs(t);
    // f64::max(w, 0.0); w is never NaN.
    return w > 0.0 ? w : 0.0;
}

__device__ __forceinline__ PilRow pil_row(u32 in_size, u32 out_size, u32 xx) {
    PilRow r;
    double scale = (double)in_size / (double)out_size;
    r.filter_scale = scale > 1.0 ? scale : 1.0;
    double support = r.filter_scale;
    r.center = ((double)xx + 0.5) * scale;
    // `as i64` truncates toward zero, as the C cast does.
    r.xmin = (i64)(r.center - support + 0.5);
    if (r.xmin < 0) r.xmin = 0;
    r.xmax = (i64)(r.center + support + 0.5);
    if (r.xmax > (i64)in_size) r.xmax = (i64)in_size;
    // The sum in input order from zero, as `Iterator::sum` adds.
    r.total = 0.0;
    for (i64 x = r.xmin; x < r.xmax; ++x) r.total += pil_weight(&r, x);
    return r;
}

// Weight `k` of the row, normalised as `bilinear_weights` returns it.
__device__ __forceinline__ double pil_normalised(const PilRow* r, u32 k) {
    double w = pil_weight(r, r->xmin + (i64)k);
    return r->total != 0.0 ? w / r->total : w;
}

__device__ __forceinline__ u32 pil_count(const PilRow* r) {
    return r->xmax > r->xmin ? (u32)(r->xmax - r->xmin) : 0u;
}

// Output `i`'s row of PIL's bilinear taps, its first input and count written: what both
// PIL tables start with.
__device__ __forceinline__ PilRow pil_row_placed(
    u32 in_size, u32 out_size, u32 i, u32* first, u32* count) {
    PilRow r = pil_row(in_size, out_size, i);
    first[i] = (u32)r.xmin;
    count[i] = pil_count(&r);
    return r;
}

// PIL's 22-bit fixed-point taps (`Taps::bilinear`, `normalize_coeffs_8bpc`), `stride`
// weights per output, zero-padded past `count`.
extern "C" __global__ void taps_pil_fixed(
    u32 in_size, u32 out_size, u32 stride, u32* first, u32* count, i32* weights) {
    u64 i = global_index();
    if (i >= out_size) return;
    PilRow r = pil_row_placed(in_size, out_size, (u32)i, first, count);
    u32 n = pil_count(&r);
    i32* out = weights + i * stride;
    for (u32 k = 0; k < stride; ++k) {
        i32 v = 0;
        if (k < n) {
            double scaled = pil_normalised(&r, k) * (double)(1u << 22);
            v = scaled < 0.0 ? (i32)(scaled - 0.5) : (i32)(scaled + 0.5);
        }
        out[k] = v;
    }
}

// PIL's bilinear weights rounded to f32 (`UpsampleTaps::bilinear`): the guided filter's
// upsampling.
extern "C" __global__ void taps_pil_f32(
    u32 in_size, u32 out_size, u32 stride, u32* first, u32* count, float* weights) {
    u64 i = global_index();
    if (i >= out_size) return;
    PilRow r = pil_row_placed(in_size, out_size, (u32)i, first, count);
    u32 n = pil_count(&r);
    float* out = weights + i * stride;
    for (u32 k = 0; k < stride; ++k) out[k] = k < n ? (float)pil_normalised(&r, k) : 0.0f;
}

// fast_image_resize's bilinear weight of input `x` (`ConvolutionTaps::bilinear`).
__device__ __forceinline__ double convolution_weight(u32 x, double center, double recip) {
    double t = fabs(((double)x - center) * recip);
    return t < 1.0 ? 1.0 - t : 0.0;
}

// fast_image_resize's convolution coefficients (`ConvolutionTaps::bilinear(..).to_f32()`):
// leading zero weights skipped, trailing ones left out of `count` (but kept in the row),
// the row normalised by its sum and cut or zero-padded to `window` entries.
extern "C" __global__ void taps_convolution_f32(
    u32 in_size, u32 out_size, u32 window, u32* first, u32* count, float* weights) {
    u64 i = global_index();
    if (i >= out_size) return;
    double scale = (double)in_size / (double)out_size;
    double filter_scale = scale > 1.0 ? scale : 1.0;
    double filter_radius = filter_scale;
    double recip = 1.0 / filter_scale;
    double in_center = ((double)i + 0.5) * scale;
    double lo = floor(in_center - filter_radius);
    lo = lo > 0.0 ? lo : 0.0;
    double hi = ceil(in_center + filter_radius);
    hi = hi < (double)in_size ? hi : (double)in_size;
    u32 x_min = (u32)lo;
    u32 x_max = (u32)hi;
    double center = in_center - 0.5;
    u32 bound_start = x_min;
    u32 bound_end = x_min;
    bool any = false;
    double ww = 0.0;
    for (u32 x = x_min; x < x_max; ++x) {
        double w = convolution_weight(x, center, recip);
        if (x == bound_start && w == 0.0) {
            bound_start += 1;
        } else {
            ww += w;
            if (w != 0.0) {
                bound_end = x + 1;
                any = true;
            }
        }
    }
    if (!any) bound_end = bound_start;
    first[i] = bound_start;
    count[i] = bound_end - bound_start;
    u32 pushed = x_max > bound_start ? x_max - bound_start : 0u;
    float* out = weights + i * window;
    for (u32 k = 0; k < window; ++k) {
        float v = 0.0f;
        if (k < pushed) {
            double w = convolution_weight(bound_start + k, center, recip);
            v = (float)(ww != 0.0 ? w / ww : w);
        }
        out[k] = v;
    }
}

// PIL NEAREST's source indices for both axes (`taps::nearest_indices`): thread 0 the
// columns (`src_w` -> `dst_w` into `xs`), thread 1 the rows. The index is a running f64
// sum, whose bits depend on every earlier addition: one thread makes a whole axis.
extern "C" __global__ void nearest_indices(
    u32 src_w, u32 dst_w, u32 src_h, u32 dst_h, u32* xs, u32* ys) {
    u64 t = global_index();
    if (t > 1) return;
    u32 src = t == 0 ? src_w : src_h;
    u32 dst = t == 0 ? dst_w : dst_h;
    u32* out = t == 0 ? xs : ys;
    double step = (double)src / (double)dst;
    double at = 0.5 * step;
    u32 last = src > 0 ? src - 1 : 0u;
    for (u32 k = 0; k < dst; ++k) {
        u32 v = (u32)at;
        out[k] = v < last ? v : last;
        at += step;
    }
}
