// Guided filter fit (src/stages/guided_filter.rs, `coefficients`): luma guide I, mask p
// (clamped to [0, 1] as `fit` does), box means over the (2r+1)^2 window clipped to the
// image, at the fit's resolution (1/subsample of the source). Each box sum runs in the
// CPU's order (BoxFilter::mean: a running sum along each row, stored as f32, then a
// running sum down each column of the f32 row sums), but where the CPU accumulates in
// f64 these accumulate without FP64 (1/32 to 1/64 of FP32 on T4, A10G, L4):
// - Pass 1 (I, p, I*p, I*I; every value in [0, 1]) in fixed point: an i64 count of
//   2^-K, K = 62 - bits((2r+1)^2) (57 at r = 2, 43 at the largest radius), so no window
//   sum can overflow and a running sum never drifts (integer adds are exact). Every luma
//   is a multiple of 2^-35 (its least non-zero value, B = 1, is above 2^-12) and so is
//   every f32 row sum of them, so the sums of I are exact, as the CPU's f64 sums of them
//   are: mean_I is the CPU's bit for bit. Every I*I is a multiple of 2^-46: exact too
//   for r <= 127 (K >= 46), and the CPU's f64 is where its sums fit 53 bits. p and I*p
//   are rounded to the nearest 2^-K each, so their means are off by at most 2^-K
//   (1e-13) from the exact means: the CPU's f32 means but for those within that of a
//   rounding boundary. The f32 store of each sum is the CPU's rounding of it.
// - Pass 2 (a and b, of any sign and size) in float-float: a pair (hi, lo) of f32 with
//   hi + lo the sum, each add by two exact 2Sums (Knuth's; no FMA) and one rounding
//   that is 2^-24 of an ulp: the ~2 x 4032 adds of a running sum err by at most 2^-34 of
//   its largest value (WideSum says why), far below half an f32 step (2^-25) of the
//   result, which is `hi`, the f32 nearest hi + lo.
// A NaN (an all-NaN mask region) makes a chain NaN from there on, as it does the CPU's
// f64 chain. tests/cuda_gpu.rs holds the fit to the CPU stage by a measured bound.
// Fused: the four means of pass 1 are consumed where they are produced, into a and b.
// The model is applied at full size by composite.cu.
//
// Launch shapes (src/cuda/launch.rs `guided_fit_launches` computes them):
// - Row passes (box_rows_guide, box_rows_coefficients): 1-D grid of one-warp blocks
//   (32 threads). A block owns a tile of ROWS consecutive image rows and KINDS sums per
//   row, ROWS * KINDS = 32: 8 rows x 4 sums (I, p, I*p, I*I) in pass 1, 16 rows x 2 sums
//   (a, b) in pass 2, so ceil(h / 8) and ceil(h / 16) blocks, each lane one (row, sum)
//   chain. The row is walked 32 columns at a time: the warp loads the tile's entering
//   samples (columns x0 + r + 1 ..) and leaving samples (columns x0 - r ..) of both input
//   planes into shared memory, lane t reading column x0 + t of one row after another, so
//   every load instruction reads 32 consecutive floats of one row (coalesced); the next
//   tile's loads are issued into registers before the current tile is summed. Each lane
//   writes its 32 outputs into a shared tile, which the warp stores the same way, 32
//   consecutive floats of one row of one plane per store.
// - Column passes (box_columns_coefficients, box_columns_means): one thread per column
//   in one-warp blocks, ceil(w / 32) of them, so that the few warps there are spread over
//   as many SMs. A warp holds 32 consecutive columns: each step's loads and stores are 32
//   consecutive floats of one row (coalesced). Pass 1 keeps its four sums in one thread,
//   as four independent chains, because a and b need all four means at once. The column
//   is walked 32 / KINDS rows at a time (ColumnTiles): the next tile's entering and
//   leaving samples are loaded into registers before the current tile is summed, so a
//   lane waits for memory once a tile rather than once a row (with so few warps, none
//   hides another's wait).
// Each lane's chain is sequential by construction (2 dependent adds per sample), so a
// pass takes at least w (rows) or h (columns) such steps; the row passes used to take 4w
// (2w in pass 2) per thread, their sums one after another, on fewer SMs.
//
// The order of operations that produces each output is a function of (row, sum) alone,
// and each chain is run by exactly one lane, in the CPU's order: s = 0, then s + v for
// columns 0 ..= min(r, w - 1), then for each x the f32 store of s, s + v(x + r + 1) while
// x + r + 1 < w, s - v(x - r) while x >= r. Tiling only changes where v is read from
// (shared memory, filled from the same floats), and v itself is the same f32 expression
// as the CPU's (I, clamp(p), I * clamp(p), I * I; a; b), selected per lane without
// changing its rounding. Splitting the four sums of a row across lanes only runs
// independent chains side by side; no chain is split or reordered. Lanes of rows past
// the image run the same steps on zeros (so that every lane reaches every __syncthreads)
// and store nothing. The column passes keep the CPU's order the same way
// (box_columns_tiled says it); the tiles only load the same floats earlier.
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

// The fixed-point fraction bits of pass 1 for radius r: the most that keep every
// running sum (at most (2r+1)^2 + 2r+1 values of at most 1 + 2^-23) below 2^63.
__device__ __forceinline__ i32 fixed_bits(u32 r) {
    u64 side = 2ull * r + 1ull;
    u64 area = side * side;
    i32 bits = 0;
    for (; area != 0ull; area >>= 1) ++bits;
    return 62 - bits;
}

// 2^e, exactly, for -126 <= e <= 127.
__device__ __forceinline__ float exp2_exact(i32 e) {
    return __int_as_float((127 + e) << 23);
}

// A quiet NaN: what a chain that summed a NaN stores.
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// A pass-1 running sum in fixed point: `units` of 2^-K (see the header). Each value is
// rounded to its nearest unit (exact for I and for values of at least 2^(23 - K)); the
// adds are exact, so the sum never drifts, and its f32 value is the f32 nearest it, as
// the CPU's `s as f32` is of its f64 sum.
struct FixedSum {
    i64 units;
    bool nan;
    float scale;  // 2^K
    float unit;   // 2^-K
    static __device__ __forceinline__ FixedSum start(u32 r) {
        i32 k = fixed_bits(r);
        return FixedSum{0, false, exp2_exact(k), exp2_exact(-k)};
    }
    __device__ __forceinline__ void add(float v) {
        if (v != v) nan = true;
        else units += llrintf(v * scale);
    }
    __device__ __forceinline__ void sub(float v) {
        if (v != v) nan = true;
        else units -= llrintf(v * scale);
    }
    // cvt.rn.f32.s64, then an exact scaling by a power of two (the result is at least
    // 2^-62 unless 0: never subnormal).
    __device__ __forceinline__ float value() const {
        return nan ? quiet_nan() : (float)units * unit;
    }
};

// Knuth's 2Sum: returns RN(a + b) and sets *err so that the two add up to a + b exactly,
// for any finite a and b, in round-to-nearest without FMA (--fmad=false keeps it so).
__device__ __forceinline__ float two_sum(float a, float b, float* err) {
    float s = a + b;
    float b_part = s - a;
    *err = (a - (s - b_part)) + (b - b_part);
    return s;
}

// A pass-2 running sum in float-float: hi + lo, |lo| at most half an ulp of hi. Adding v:
// (s, e) = 2Sum(hi, v), then (hi, lo) = 2Sum(s, lo + e). Only `lo + e` rounds, by at most
// 2^-24 of itself, and |lo|, |e| are at most half an ulp of hi and of s: an add errs by
// at most 2^-48 (|hi| + |s|), so the ~2 x 4032 adds of a row err by at most 2^-34 of its
// largest running sum (f64: 2^-40). `hi` is the f32 nearest hi + lo: the value stored.
// An infinite or NaN sum stays in `hi` with lo = 0 (2Sum's error is NaN then), as the f64
// sum stays infinite until an infinity leaves, and NaN from then on.
struct WideSum {
    float hi;
    float lo;
    static __device__ __forceinline__ WideSum start(u32) { return WideSum{0.0f, 0.0f}; }
    __device__ __forceinline__ void add(float v) {
        float e, lo_sum;
        float s = two_sum(hi, v, &e);
        float z = two_sum(s, lo + e, &lo_sum);
        bool finite = s - s == 0.0f;
        hi = finite ? z : s;
        lo = finite ? lo_sum : 0.0f;
    }
    __device__ __forceinline__ void sub(float v) { add(-v); }
    __device__ __forceinline__ float value() const { return hi; }
};

#if defined(__CUDACC__)
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

// Columns per tile of the row passes: one warp-wide load reads one tile row.
#define ROW_TILE 32u

// Shared tiles of a row-pass block: KINDS sums of 32 / KINDS rows from two input planes.
// Rows are padded to 33 floats so that the lanes reading column j of different rows (or
// writing column j of different sums) fall in different banks.
template <u32 KINDS>
struct RowTiles {
    static constexpr u32 ROWS = 32u / KINDS;
    float enter[2][ROWS][ROW_TILE + 1u];
    float leave[2][ROWS][ROW_TILE + 1u];
    float out[KINDS][ROWS][ROW_TILE + 1u];
};

// Lane `lane`'s share of the tile for outputs x0 .. x0 + 31 into registers: for each row
// and plane, the entering sample (column x0 + lane + r + 1) and the leaving one (column
// x0 + lane - r), 0 where the column or row is outside the image (never read then).
template <u32 ROWS>
__device__ __forceinline__ void load_row_tiles(
    float (&pre)[2][2][ROWS], const float* in0, const float* in1, u64 y0, u32 w, u32 h,
    u32 r, u64 x0, u32 lane) {
    u64 enter = x0 + lane + r + 1u;
    u64 at = x0 + lane;
    bool enters = enter < w;
    bool leaves = at >= r && at - r < w;
    u64 leave = leaves ? at - r : 0u;
    UNROLL for (u32 row = 0; row < ROWS; ++row) {
        u64 y = y0 + row;
        bool inside = y < h;
        pre[0][0][row] = inside && enters ? in0[y * w + enter] : 0.0f;
        pre[0][1][row] = inside && enters ? in1[y * w + enter] : 0.0f;
        pre[1][0][row] = inside && leaves ? in0[y * w + leave] : 0.0f;
        pre[1][1][row] = inside && leaves ? in1[y * w + leave] : 0.0f;
    }
}

template <u32 KINDS>
__device__ __forceinline__ void store_row_tiles(
    RowTiles<KINDS>& t, const float (&pre)[2][2][RowTiles<KINDS>::ROWS], u32 lane) {
    UNROLL for (u32 row = 0; row < RowTiles<KINDS>::ROWS; ++row) {
        t.enter[0][row][lane] = pre[0][0][row];
        t.enter[1][row][lane] = pre[0][1][row];
        t.leave[0][row][lane] = pre[1][0][row];
        t.leave[1][row][lane] = pre[1][1][row];
    }
}

// The running window sums along the rows of one tile of rows (see the header): lane
// `kind * ROWS + q` runs the chain of sum `kind` of row blockIdx.x * ROWS + q over the
// values Sums::value(in0, in1, kind) and writes it to out[kind]. Every lane runs every
// step (the loops depend on w and r only), so each __syncthreads is reached by all.
template <typename Sums>
__device__ __forceinline__ void box_rows_tiled(
    RowTiles<Sums::KINDS>& t, const float* in0, const float* in1, u32 w, u32 h, u32 r,
    float* const (&out)[Sums::KINDS]) {
    constexpr u32 KINDS = Sums::KINDS;
    constexpr u32 ROWS = RowTiles<KINDS>::ROWS;
    const u32 lane = threadIdx.x;
    const u32 q = lane % ROWS;
    const u32 kind = lane / ROWS;
    const u64 y0 = (u64)blockIdx.x * ROWS;

    // s = the sum of columns 0 ..= min(r, w - 1), added in column order.
    const u32 first_end = r < w - 1u ? r : w - 1u;
    typename Sums::Acc s = Sums::Acc::start(r);
    for (u64 c0 = 0; c0 <= first_end; c0 += ROW_TILE) {
        __syncthreads();
        u64 col = c0 + lane;
        UNROLL for (u32 row = 0; row < ROWS; ++row) {
            u64 y = y0 + row;
            bool inside = y < h && col <= first_end;
            t.enter[0][row][lane] = inside ? in0[y * w + col] : 0.0f;
            t.enter[1][row][lane] = inside ? in1[y * w + col] : 0.0f;
        }
        __syncthreads();
        u64 left = (u64)first_end + 1u - c0;
        u32 n = left < ROW_TILE ? (u32)left : ROW_TILE;
        for (u32 j = 0; j < n; ++j) {
            s.add(Sums::value(t.enter[0][q][j], t.enter[1][q][j], kind));
        }
    }

    // Then tile by tile: store s as f32 at x, add the entering sample, subtract the
    // leaving one, while the next tile's samples are in flight into `pre`.
    float pre[2][2][ROWS];
    load_row_tiles<ROWS>(pre, in0, in1, y0, w, h, r, 0u, lane);
    __syncthreads();
    store_row_tiles<KINDS>(t, pre, lane);
    for (u64 x0 = 0; x0 < w; x0 += ROW_TILE) {
        __syncthreads();
        bool more = x0 + ROW_TILE < w;
        if (more) load_row_tiles<ROWS>(pre, in0, in1, y0, w, h, r, x0 + ROW_TILE, lane);
        u64 left = (u64)w - x0;
        u32 n = left < ROW_TILE ? (u32)left : ROW_TILE;
        UNROLL for (u32 j = 0; j < ROW_TILE; ++j) {
            if (j >= n) break;
            u64 x = x0 + j;
            t.out[kind][q][j] = s.value();
            if (x + r + 1u < w) {
                s.add(Sums::value(t.enter[0][q][j], t.enter[1][q][j], kind));
            }
            if (x >= r) {
                s.sub(Sums::value(t.leave[0][q][j], t.leave[1][q][j], kind));
            }
        }
        __syncthreads();
        u64 col = x0 + lane;
        UNROLL for (u32 k = 0; k < KINDS; ++k) {
            UNROLL for (u32 row = 0; row < ROWS; ++row) {
                u64 y = y0 + row;
                if (y < h && col < w) out[k][y * w + col] = t.out[k][row][lane];
            }
        }
        if (more) store_row_tiles<KINDS>(t, pre, lane);
    }
}

// Pass 1's values: I, p, I * p and I * I, p clamped to [0, 1] (selects, no branches: the
// four kinds share a warp), all in [0, 1]: summed in fixed point.
struct GuideSums {
    static constexpr u32 KINDS = 4u;
    typedef FixedSum Acc;
    static __device__ __forceinline__ float value(float guide, float p, u32 kind) {
        float pc = clamp_unit(p);
        float lhs = kind == 1u ? pc : guide;
        float rhs = kind == 2u ? pc : guide;
        return kind < 2u ? lhs : lhs * rhs;
    }
};

// Pass 2's values: a and b, of any size: summed in float-float.
struct CoefficientSums {
    static constexpr u32 KINDS = 2u;
    typedef WideSum Acc;
    static __device__ __forceinline__ float value(float a, float b, u32 kind) {
        return kind == 0u ? a : b;
    }
};

// Rows per tile of the column passes: 32 / KINDS (8 rows of 4 sums in pass 1, 16 of 2
// in pass 2), so that a lane's loads in flight, 2 * KINDS * ROWS = 64 floats, fit its
// registers in both passes.
// The tile a lane sums is kept in shared memory, and only the next one in registers
// (`pre`), as the row passes do: a lane reads back only its own column (lane `lane` of
// each row), so no __syncthreads is needed, and the registers hold one tile instead of
// two.
template <u32 KINDS>
struct ColumnTiles {
    static constexpr u32 ROWS = 32u / KINDS;
    float enter[KINDS][ROWS][32];
    float leave[KINDS][ROWS][32];
};

// Column x's entering samples (rows y + r + 1) and leaving samples (rows y - r) for the
// outputs y = y0 .. y0 + ROWS - 1 of each input plane into registers, 0 where the row is
// outside the image (never read then). The warp's loads of one row are 32 consecutive
// floats (coalesced).
template <u32 KINDS>
__device__ __forceinline__ void load_column_tiles(
    float (&pre)[2][KINDS][ColumnTiles<KINDS>::ROWS], const float* const (&in)[KINDS],
    u64 x, u32 w, u32 h, u32 r, u64 y0) {
    UNROLL for (u32 j = 0; j < ColumnTiles<KINDS>::ROWS; ++j) {
        u64 y = y0 + j;
        u64 enter = y + r + 1u;
        bool enters = enter < h;
        bool leaves = y >= r && y < h;
        u64 leave = leaves ? y - r : 0u;
        UNROLL for (u32 k = 0; k < KINDS; ++k) {
            pre[0][k][j] = enters ? in[k][enter * w + x] : 0.0f;
            pre[1][k][j] = leaves ? in[k][leave * w + x] : 0.0f;
        }
    }
}

// The running window sums down column x = global_index() of the KINDS row-sum planes
// `in`, each its own chain (an Out::Acc) in the CPU's order: acc = 0, then acc + v for
// rows 0 ..= min(r, h - 1), then for each y `out.store` of the means at (x, y), acc + v
// of row y + r + 1 while y + r + 1 < h, acc - v of row y - r while y >= r. Tiling only
// changes when the values are loaded: the next ROWS rows' entering and leaving samples
// are in flight into registers while the current ones are summed from shared memory.
template <typename Out>
__device__ __forceinline__ void box_columns_tiled(
    ColumnTiles<Out::KINDS>& t, const float* const (&in)[Out::KINDS], u32 w, u32 h, u32 r,
    const Out& out) {
    constexpr u32 KINDS = Out::KINDS;
    constexpr u32 ROWS = ColumnTiles<KINDS>::ROWS;
    u64 x = global_index();
    if (x >= w) return;
    const u32 lane = threadIdx.x;
    float inv_count_x = 1.0f / (float)window_len((u32)x, r, w);
    typename Out::Acc acc[KINDS];
    UNROLL for (u32 k = 0; k < KINDS; ++k) acc[k] = Out::Acc::start(r);
    u32 first_end = r < h - 1u ? r : h - 1u;
    for (u32 y = 0; y <= first_end; ++y) {
        u64 i = (u64)y * w + x;
        UNROLL for (u32 k = 0; k < KINDS; ++k) acc[k].add(in[k][i]);
    }
    float pre[2][KINDS][ROWS];
    load_column_tiles<KINDS>(pre, in, x, w, h, r, 0u);
    for (u64 y0 = 0; y0 < h; y0 += ROWS) {
        UNROLL for (u32 j = 0; j < ROWS; ++j) {
            UNROLL for (u32 k = 0; k < KINDS; ++k) {
                t.enter[k][j][lane] = pre[0][k][j];
                t.leave[k][j][lane] = pre[1][k][j];
            }
        }
        if (y0 + ROWS < h) load_column_tiles<KINDS>(pre, in, x, w, h, r, y0 + ROWS);
        UNROLL for (u32 j = 0; j < ROWS; ++j) {
            u64 y = y0 + j;
            if (y >= h) break;
            float inv_count_y = 1.0f / (float)window_len((u32)y, r, h);
            out.store(acc, inv_count_x, inv_count_y, y * w + x);
            if (y + r + 1u < h) {
                UNROLL for (u32 k = 0; k < KINDS; ++k) {
                    acc[k].add(t.enter[k][j][lane]);
                }
            }
            if (y >= r) {
                UNROLL for (u32 k = 0; k < KINDS; ++k) {
                    acc[k].sub(t.leave[k][j][lane]);
                }
            }
        }
    }
}

// Pass 1's outputs from the four column sums: the means, then a and b, each f32
// expression as `coefficients` writes it.
struct CoefficientsOut {
    static constexpr u32 KINDS = 4u;
    typedef FixedSum Acc;
    float epsilon;
    float* a;
    float* b;
    __device__ __forceinline__ void store(
        const Acc (&acc)[KINDS], float inv_count_x, float inv_count_y, u64 i) const {
        float mean_i = acc[0].value() * inv_count_x * inv_count_y;
        float mean_p = acc[1].value() * inv_count_x * inv_count_y;
        float corr_ip = acc[2].value() * inv_count_x * inv_count_y;
        float corr_ii = acc[3].value() * inv_count_x * inv_count_y;
        float cov = corr_ip - mean_i * mean_p;
        float var = corr_ii - mean_i * mean_i;
        float ak = cov / (var + epsilon);
        a[i] = ak;
        b[i] = mean_p - ak * mean_i;
    }
};

// Pass 2's outputs: mean_a and mean_b.
struct MeansOut {
    static constexpr u32 KINDS = 2u;
    typedef WideSum Acc;
    float* mean_a;
    float* mean_b;
    __device__ __forceinline__ void store(
        const Acc (&acc)[KINDS], float inv_count_x, float inv_count_y, u64 i) const {
        mean_a[i] = acc[0].value() * inv_count_x * inv_count_y;
        mean_b[i] = acc[1].value() * inv_count_x * inv_count_y;
    }
};

// Pass 1, rows: window sums of I, p, I*p and I*I along each row; p is read clamped to
// [0, 1]. One-warp blocks of 8 rows x 4 sums (see the header).
extern "C" __global__ void box_rows_guide(
    const float* guide, const float* p, u32 w, u32 h, u32 r,
    float* sum_i, float* sum_p, float* sum_ip, float* sum_ii) {
    __shared__ RowTiles<GuideSums::KINDS> tiles;
    float* const out[GuideSums::KINDS] = {sum_i, sum_p, sum_ip, sum_ii};
    box_rows_tiled<GuideSums>(tiles, guide, p, w, h, r, out);
}

// Pass 1, columns: the four running column sums of the row sums give mean_I, mean_p,
// corr_Ip, corr_II at each pixel; a and b follow at once (one thread per column).
extern "C" __global__ void box_columns_coefficients(
    const float* sum_i, const float* sum_p, const float* sum_ip, const float* sum_ii,
    u32 w, u32 h, u32 r, float epsilon, float* a, float* b) {
    __shared__ ColumnTiles<CoefficientsOut::KINDS> tiles;
    const float* const in[CoefficientsOut::KINDS] = {sum_i, sum_p, sum_ip, sum_ii};
    box_columns_tiled(tiles, in, w, h, r, CoefficientsOut{epsilon, a, b});
}

// Pass 2, rows: window sums of a and b along each row. One-warp blocks of 16 rows x 2
// sums (see the header).
extern "C" __global__ void box_rows_coefficients(
    const float* a, const float* b, u32 w, u32 h, u32 r, float* sum_a, float* sum_b) {
    __shared__ RowTiles<CoefficientSums::KINDS> tiles;
    float* const out[CoefficientSums::KINDS] = {sum_a, sum_b};
    box_rows_tiled<CoefficientSums>(tiles, a, b, w, h, r, out);
}

// Pass 2, columns: mean_a and mean_b, the fitted model (one thread per column).
extern "C" __global__ void box_columns_means(
    const float* sum_a, const float* sum_b, u32 w, u32 h, u32 r,
    float* mean_a, float* mean_b) {
    __shared__ ColumnTiles<MeansOut::KINDS> tiles;
    const float* const in[MeansOut::KINDS] = {sum_a, sum_b};
    box_columns_tiled(tiles, in, w, h, r, MeansOut{mean_a, mean_b});
}
