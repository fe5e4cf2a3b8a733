// Guided filter fit (src/pipeline/guided_filter.rs, `coefficients`): luma guide I, mask p
// (clamped to [0, 1] as `fit` does), box means over the (2r+1)^2 window clipped to the
// image, at the fit's resolution (1/subsample of the source). Each box sum runs in f64 in
// the CPU's exact order (a running sum along each row, then along each column of the f32
// row sums: one thread per row or column), so the means, a, b, mean_a and mean_b are the
// CPU's bit for bit. Fused: the four means of pass 1 are consumed where they are
// produced, into a and b. The model is applied at full size by composite.cu.
#include "common.cuh"

// Luma in [0, 1], BT.601 weights, f32 in the CPU's order.
extern "C" __global__ void luma_rgb8(const u8* rgb, u32 n, float* out) {
    u64 i = global_index();
    if (i >= n) return;
    out[i] = luma_of(rgb + i * 3u);
}

// `v.clamp(0.0, 1.0)` as Rust does it: a NaN stays NaN (fminf/fmaxf would drop it).
__device__ __forceinline__ float clamp_unit(float v) {
    return v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v);
}

// How many of the samples i - r ..= i + r fall inside 0..len.
__device__ __forceinline__ u32 window_len(u32 i, u32 r, u32 len) {
    u32 hi = (u64)i + r < len ? i + r : len - 1u;
    u32 lo = i > r ? i - r : 0u;
    return hi - lo + 1u;
}

// Running window sum along one line of `len` samples read by `at(k)`, written as f32.
// The order of adds and subtracts is BoxFilter::mean's horizontal loop.
#define ROW_RUNNING_SUM(len, r, at, store)                          \
    {                                                               \
        double s = 0.0;                                             \
        u32 first_end = (r) < (len) - 1u ? (r) : (len) - 1u;        \
        for (u32 k = 0; k <= first_end; ++k) s = s + (double)(at(k)); \
        for (u32 x = 0; x < (len); ++x) {                           \
            store(x, (float)s);                                     \
            if ((u64)x + (r) + 1u < (len)) s = s + (double)(at(x + (r) + 1u)); \
            if (x >= (r)) s = s - (double)(at(x - (r)));            \
        }                                                           \
    }

// Pass 1, rows: window sums of I, p, I*p and I*I along each row (one thread per row);
// p is read clamped to [0, 1].
extern "C" __global__ void box_rows_guide(
    const float* guide, const float* p, u32 w, u32 h, u32 r,
    float* sum_i, float* sum_p, float* sum_ip, float* sum_ii) {
    u64 y = global_index();
    if (y >= h) return;
    const float* gi = guide + y * w;
    const float* pi = p + y * w;
    u64 base = y * w;
#define AT_I(k) gi[k]
#define AT_P(k) clamp_unit(pi[k])
#define AT_IP(k) (gi[k] * clamp_unit(pi[k]))
#define AT_II(k) (gi[k] * gi[k])
#define STORE_I(x, v) sum_i[base + (x)] = (v)
#define STORE_P(x, v) sum_p[base + (x)] = (v)
#define STORE_IP(x, v) sum_ip[base + (x)] = (v)
#define STORE_II(x, v) sum_ii[base + (x)] = (v)
    ROW_RUNNING_SUM(w, r, AT_I, STORE_I)
    ROW_RUNNING_SUM(w, r, AT_P, STORE_P)
    ROW_RUNNING_SUM(w, r, AT_IP, STORE_IP)
    ROW_RUNNING_SUM(w, r, AT_II, STORE_II)
}

// Pass 1, columns: the four running column sums of the row sums give mean_I, mean_p,
// corr_Ip, corr_II at each pixel; a and b follow at once (one thread per column).
extern "C" __global__ void box_columns_coefficients(
    const float* sum_i, const float* sum_p, const float* sum_ip, const float* sum_ii,
    u32 w, u32 h, u32 r, float epsilon, float* a, float* b) {
    u64 x = global_index();
    if (x >= w) return;
    float inv_count_x = 1.0f / (float)window_len((u32)x, r, w);
    double acc_i = 0.0, acc_p = 0.0, acc_ip = 0.0, acc_ii = 0.0;
    u32 first_end = r < h - 1u ? r : h - 1u;
    for (u32 y = 0; y <= first_end; ++y) {
        u64 k = (u64)y * w + x;
        acc_i = acc_i + (double)sum_i[k];
        acc_p = acc_p + (double)sum_p[k];
        acc_ip = acc_ip + (double)sum_ip[k];
        acc_ii = acc_ii + (double)sum_ii[k];
    }
    for (u32 y = 0; y < h; ++y) {
        float inv_count_y = 1.0f / (float)window_len(y, r, h);
        float mean_i = (float)acc_i * inv_count_x * inv_count_y;
        float mean_p = (float)acc_p * inv_count_x * inv_count_y;
        float corr_ip = (float)acc_ip * inv_count_x * inv_count_y;
        float corr_ii = (float)acc_ii * inv_count_x * inv_count_y;
        float cov = corr_ip - mean_i * mean_p;
        float var = corr_ii - mean_i * mean_i;
        float ak = cov / (var + epsilon);
        u64 k = (u64)y * w + x;
        a[k] = ak;
        b[k] = mean_p - ak * mean_i;
        if ((u64)y + r + 1u < h) {
            u64 n = ((u64)y + r + 1u) * w + x;
            acc_i = acc_i + (double)sum_i[n];
            acc_p = acc_p + (double)sum_p[n];
            acc_ip = acc_ip + (double)sum_ip[n];
            acc_ii = acc_ii + (double)sum_ii[n];
        }
        if (y >= r) {
            u64 o = ((u64)y - r) * w + x;
            acc_i = acc_i + -(double)sum_i[o];
            acc_p = acc_p + -(double)sum_p[o];
            acc_ip = acc_ip + -(double)sum_ip[o];
            acc_ii = acc_ii + -(double)sum_ii[o];
        }
    }
}

// Pass 2, rows: window sums of a and b along each row.
extern "C" __global__ void box_rows_coefficients(
    const float* a, const float* b, u32 w, u32 h, u32 r, float* sum_a, float* sum_b) {
    u64 y = global_index();
    if (y >= h) return;
    const float* ai = a + y * w;
    const float* bi = b + y * w;
    u64 base = y * w;
#define AT_A(k) ai[k]
#define AT_B(k) bi[k]
#define STORE_A(x, v) sum_a[base + (x)] = (v)
#define STORE_B(x, v) sum_b[base + (x)] = (v)
    ROW_RUNNING_SUM(w, r, AT_A, STORE_A)
    ROW_RUNNING_SUM(w, r, AT_B, STORE_B)
}

// Pass 2, columns: mean_a and mean_b, the fitted model (one thread per column).
extern "C" __global__ void box_columns_means(
    const float* sum_a, const float* sum_b, u32 w, u32 h, u32 r,
    float* mean_a, float* mean_b) {
    u64 x = global_index();
    if (x >= w) return;
    float inv_count_x = 1.0f / (float)window_len((u32)x, r, w);
    double acc_a = 0.0, acc_b = 0.0;
    u32 first_end = r < h - 1u ? r : h - 1u;
    for (u32 y = 0; y <= first_end; ++y) {
        acc_a = acc_a + (double)sum_a[(u64)y * w + x];
        acc_b = acc_b + (double)sum_b[(u64)y * w + x];
    }
    for (u32 y = 0; y < h; ++y) {
        float inv_count_y = 1.0f / (float)window_len(y, r, h);
        u64 k = (u64)y * w + x;
        mean_a[k] = (float)acc_a * inv_count_x * inv_count_y;
        mean_b[k] = (float)acc_b * inv_count_x * inv_count_y;
        if ((u64)y + r + 1u < h) {
            acc_a = acc_a + (double)sum_a[((u64)y + r + 1u) * w + x];
            acc_b = acc_b + (double)sum_b[((u64)y + r + 1u) * w + x];
        }
        if (y >= r) {
            acc_a = acc_a + -(double)sum_a[((u64)y - r) * w + x];
            acc_b = acc_b + -(double)sum_b[((u64)y - r) * w + x];
        }
    }
}
