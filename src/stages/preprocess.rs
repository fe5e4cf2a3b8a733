//! Preprocess: resize the source RGB8 to a model's input size and normalise it straight
//! into the planar NCHW f32 buffer the model reads. The resize is PIL's
//! `Image.resize(size, BILINEAR)` to the bit: same coefficients, same 22-bit fixed point,
//! same order of passes with rounding to u8 between them. Models are trained on PIL's
//! output and our reference is PIL; a +-1 LSB difference flips trimap pixels of the
//! U2Net family, so "close" is not enough. The CUDA kernel implements the same scheme.

use super::lanes::Lanes;
use super::{Bytes, Rgb8};
use crate::spec::{Normalize, Scale};
use fast_image_resize::ResizeAlg;
use fast_image_resize::{FilterType, ResizeOptions};

/// Bilinear resampling as PIL does it, for the f32 planes (masks) that `resample` resizes:
/// a triangle filter widened by the scale factor when shrinking.
pub fn bilinear() -> ResizeOptions {
    ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
}

/// PIL's fixed-point precision for 8-bit images: 32 - 8 - 2 bits.
const PRECISION_BITS: u32 = 22;

/// Filter taps of one axis: for each output sample, the first input sample and the
/// fixed-point weights of the inputs from there.
#[derive(Debug, Clone, PartialEq)]
pub struct Taps {
    pub first: Vec<u32>,
    pub weights: Vec<Vec<i32>>,
}

impl Taps {
    /// PIL's `precompute_coeffs` with the bilinear filter, then `normalize_coeffs_8bpc`.
    pub fn bilinear(in_size: u32, out_size: u32) -> Self {
        let (first, weights) = bilinear_weights(in_size, out_size)
            .into_iter()
            .map(|(first, w)| {
                let fixed = w
                    .iter()
                    .map(|&v| {
                        let scaled = v * f64::from(1u32 << PRECISION_BITS);
                        if scaled < 0.0 {
                            (scaled - 0.5) as i32
                        } else {
                            (scaled + 0.5) as i32
                        }
                    })
                    .collect();
                (first, fixed)
            })
            .unzip();
        Self { first, weights }
    }

    fn last_used(&self) -> u32 {
        self.first
            .iter()
            .zip(&self.weights)
            .map(|(f, w)| f + w.len() as u32)
            .max()
            .unwrap_or(0)
    }
}

/// PIL's `precompute_coeffs` for the bilinear (triangle) filter: for each output sample,
/// the first input sample and the normalised weights from there. Shrinking widens the
/// triangle by the scale factor (antialiasing); at the edges the weights of the samples
/// inside the image are renormalised.
pub fn bilinear_weights(in_size: u32, out_size: u32) -> Vec<(u32, Vec<f64>)> {
    let scale = f64::from(in_size) / f64::from(out_size);
    let filter_scale = scale.max(1.0);
    let support = filter_scale; // the triangle's support is 1
    (0..out_size)
        .map(|xx| {
            let center = (f64::from(xx) + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(i64::from(in_size));
            let w: Vec<f64> = (xmin..xmax)
                .map(|x| (1.0 - ((x as f64 - center + 0.5) / filter_scale).abs()).max(0.0))
                .collect();
            let total: f64 = w.iter().sum();
            let w = if total != 0.0 {
                w.iter().map(|v| v / total).collect()
            } else {
                w
            };
            (xmin as u32, w)
        })
        .collect()
}

fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

const HALF: i32 = 1 << (PRECISION_BITS - 1);

/// Resizes interleaved RGB8 `src` to `width` x `height` into `out` (resized to fit):
/// horizontal pass over the rows the vertical pass needs, then the vertical pass.
pub fn resize_rgb(src: &Rgb8<impl Bytes>, width: u32, height: u32, out: &mut Vec<u8>) {
    resize_rgb_in(Lanes::ONE, src, width, height, out);
}

/// `resize_rgb` with each pass's rows split across `lanes` (the same bits).
pub fn resize_rgb_in(
    lanes: Lanes,
    src: &Rgb8<impl Bytes>,
    width: u32,
    height: u32,
    out: &mut Vec<u8>,
) {
    resize_rgb_with(lanes, src, width, height, true, out);
}

/// `resize_rgb_in`, the vertical pass in 16-bit arithmetic where that is exact
/// (`Exact16`) or, for the tests that hold the two to the same bits, not.
fn resize_rgb_with(
    lanes: Lanes,
    src: &Rgb8<impl Bytes>,
    width: u32,
    height: u32,
    exact16: bool,
    out: &mut Vec<u8>,
) {
    let (sw, sh) = src.dimensions();
    let out_len = width as usize * height as usize * 3;
    if (sw, sh) == (width, height) {
        out.clear();
        out.extend_from_slice(src.as_raw());
        return;
    }
    let vert = Taps::bilinear(sh, height);
    let (row0, row_end) = (vert.first[0], vert.last_used());
    // Horizontal pass into rows row0..row_end of a (width x rows) temporary.
    let horizontal;
    let (tmp, tmp_first_row): (&[u8], u32) = if sw != width {
        let horiz = PaddedTaps::of(&Taps::bilinear(sw, width), sw);
        let rows = (row_end - row0) as usize;
        let stride = width as usize * 3;
        let mut t = vec![0u8; stride * rows];
        let src_raw = src.as_raw();
        lanes.rows(&mut t, stride, |first_row, dst_rows| {
            for (r, dst) in dst_rows.chunks_exact_mut(stride).enumerate() {
                let y = row0 as usize + first_row + r;
                let line = &src_raw[y * sw as usize * 3..(y + 1) * sw as usize * 3];
                horizontal_row(line, &horiz, dst);
            }
        });
        horizontal = t;
        (&horizontal, row0)
    } else {
        (src.as_raw(), 0)
    };
    // Vertical pass: accumulate whole rows so the inner loop vectorises.
    out.resize(out_len, 0);
    if sh == height {
        out.copy_from_slice(&tmp[..out_len]);
        return;
    }
    let stride = width as usize * 3;
    let vert16: Vec<Option<Exact16>> = vert
        .weights
        .iter()
        .map(|w| exact16.then(|| Exact16::of(w)).flatten())
        .collect();
    lanes.rows(out, stride, |first_row, dst_rows| {
        let mut acc = vec![0i32; stride];
        let mut acc16 = vec![0u16; stride];
        for (r, dst) in dst_rows.chunks_exact_mut(stride).enumerate() {
            let y = first_row + r;
            let first = (vert.first[y] - tmp_first_row) as usize;
            if let Some(kernel) = &vert16[y] {
                acc16.iter_mut().for_each(|a| *a = kernel.bias);
                for (k, &c) in kernel.weights.iter().enumerate() {
                    let row = &tmp[(first + k) * stride..(first + k + 1) * stride];
                    for (a, &v) in acc16.iter_mut().zip(row) {
                        *a = a.wrapping_add(c.wrapping_mul(u16::from(v)));
                    }
                }
                for (d, &a) in dst.iter_mut().zip(&acc16) {
                    *d = kernel.narrow(a);
                }
                continue;
            }
            acc.iter_mut().for_each(|a| *a = HALF);
            for (k, &w) in vert.weights[y].iter().enumerate() {
                let row = &tmp[(first + k) * stride..(first + k + 1) * stride];
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += i32::from(v) * w;
                }
            }
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = clip8(a);
            }
        }
    });
}

/// The horizontal pass's taps with the same count for every output sample: each
/// sample's weights padded with zeros to the longest (`len`), its first input sample moved
/// left where the padding would run past the row's end. A zero weight adds nothing to the
/// sum, so the bits are `Taps`'; with the count a constant (`horizontal_row_k`) the tap
/// loop unrolls and the weights stay in registers: about a fifth off the pass at
/// 1920 -> 320 and 1920 -> 480 (12 and 8 taps), measured.
struct PaddedTaps {
    len: usize,
    /// Each output sample's first input sample.
    first: Vec<usize>,
    /// `len` weights per output sample.
    weights: Vec<i32>,
    /// Whether a sample's `len` weights read the same backwards (every sample away from
    /// the edges at a whole shrink: the triangle is symmetric about its centre), so that
    /// `horizontal_row_k` adds the pixels of each mirrored pair before one multiply:
    /// 1920 -> 320 in 4.5-5.1 ms against 5.6-6.0, 1920 -> 480 in 4.7-4.8 against 5.7-6.1
    /// (one thread, 1080 rows, alternating runs).
    mirrored: Vec<bool>,
}

impl PaddedTaps {
    fn of(taps: &Taps, in_size: u32) -> Self {
        let len = taps.weights.iter().map(Vec::len).max().unwrap_or(0);
        let mut first = Vec::with_capacity(taps.first.len());
        let mut weights = vec![0; len * taps.first.len()];
        for ((&f, w), padded) in taps
            .first
            .iter()
            .zip(&taps.weights)
            .zip(weights.chunks_exact_mut(len.max(1)))
        {
            // The weights lie within the row, so `len` samples fit from `start`.
            let start = (f as usize).min(in_size as usize - len);
            let lead = f as usize - start;
            padded[lead..lead + w.len()].copy_from_slice(w);
            first.push(start);
        }
        let mirrored = weights
            .chunks_exact(len.max(1))
            .map(|w| w.iter().eq(w.iter().rev()))
            .collect();
        Self {
            len,
            first,
            weights,
            mirrored,
        }
    }
}

/// One row of the horizontal pass: `line` (RGB8, the source width) into `dst` (RGB8,
/// the target width), with the tap count a constant where it is one of the usual ones.
fn horizontal_row(line: &[u8], taps: &PaddedTaps, dst: &mut [u8]) {
    macro_rules! unrolled {
        ($($k:literal)*) => {
            match taps.len {
                $($k => horizontal_row_k(line, taps, dst, $k),)*
                // A long filter (a shrink of more than 8x).
                k => horizontal_row_k(line, taps, dst, k.max(1)),
            }
        };
    }
    unrolled!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

/// The pass over one row with `k` taps per sample: inlined where `k` is a literal, so
/// the tap loop unrolls.
#[inline(always)]
fn horizontal_row_k(line: &[u8], taps: &PaddedTaps, dst: &mut [u8], k: usize) {
    for (((px, &first), weights), &mirrored) in dst
        .chunks_exact_mut(3)
        .zip(&taps.first)
        .zip(taps.weights.chunks_exact(k))
        .zip(&taps.mirrored)
    {
        let src = &line[first * 3..first * 3 + 3 * k];
        let (mut a0, mut a1, mut a2) = (HALF, HALF, HALF);
        if mirrored {
            // `u * w + v * w` is `(u + v) * w` in integers: half the multiplies, the
            // same sum.
            let (left, right) = src.split_at(3 * (k / 2));
            for ((l, r), &w) in left
                .chunks_exact(3)
                .zip(right.rchunks_exact(3))
                .zip(weights)
            {
                a0 += (i32::from(l[0]) + i32::from(r[0])) * w;
                a1 += (i32::from(l[1]) + i32::from(r[1])) * w;
                a2 += (i32::from(l[2]) + i32::from(r[2])) * w;
            }
            if k % 2 == 1 {
                let (m, w) = (&right[..3], weights[k / 2]);
                a0 += i32::from(m[0]) * w;
                a1 += i32::from(m[1]) * w;
                a2 += i32::from(m[2]) * w;
            }
        } else {
            for (s, &w) in src.chunks_exact(3).zip(weights) {
                a0 += i32::from(s[0]) * w;
                a1 += i32::from(s[1]) * w;
                a2 += i32::from(s[2]) * w;
            }
        }
        px[0] = clip8(a0);
        px[1] = clip8(a1);
        px[2] = clip8(a2);
    }
}

/// One output sample's weights in 16-bit arithmetic, where that gives the same bits (the
/// vertical pass uses it; a horizontal pass in lanes would filter every input pixel to
/// keep one in `scale`, and measured no faster than the scalar loop):
/// when every weight is a multiple of `2^t`, `(HALF + sum w u) >> 22` equals
/// `((HALF >> t) + sum (w >> t) u) >> (22 - t)`, and when that sum cannot pass 65535 for
/// any u8 inputs it fits a u16 lane, eight to an SSE2 register and with its multiply
/// (there is no 32-bit one before SSE4.1). So it is wherever the scale is a power of two
/// (the triangle's weights are then odd multiples of a power of two: 1 3 5 7 7 5 3 1 /
/// 32 for the guided filter's quarter-size guide); elsewhere PIL's weights are not, and
/// the 32-bit path runs.
#[derive(Debug, Clone, PartialEq)]
struct Exact16 {
    bias: u16,
    shift: u32,
    weights: Vec<u16>,
}

impl Exact16 {
    fn of(weights: &[i32]) -> Option<Self> {
        if weights.is_empty() || weights.iter().any(|&w| w < 0) {
            return None;
        }
        let t = weights
            .iter()
            .filter(|&&w| w != 0)
            .map(|w| w.trailing_zeros())
            .min()
            .unwrap_or(0)
            .min(PRECISION_BITS - 1);
        let bias = u64::from((HALF >> t) as u32);
        let sum: u64 = weights.iter().map(|&w| u64::from((w >> t) as u32)).sum();
        if bias + 255 * sum > u64::from(u16::MAX) {
            return None;
        }
        Some(Self {
            bias: bias as u16,
            shift: PRECISION_BITS - t,
            weights: weights.iter().map(|&w| (w >> t) as u16).collect(),
        })
    }

    /// The output value of an accumulated sum: `clip8`'s.
    fn narrow(&self, acc: u16) -> u8 {
        (acc >> self.shift).min(255) as u8
    }
}

/// Writes `(v * s - mean[c]) / std[c]` for each value `v` of interleaved RGB8 `rgb` into
/// planar `out` (`[R plane, G plane, B plane]`), `s` per `norm.scale`.
pub fn normalize_into(rgb: &[u8], norm: &Normalize, out: &mut [f32]) {
    let pixels = rgb.len() / 3;
    debug_assert_eq!(out.len(), pixels * 3);
    let s = match norm.scale {
        Scale::Fixed(s) => s,
        Scale::ImageMax => match rgb.iter().copied().max().unwrap_or(0) {
            0 => 1.0,
            max => 1.0 / f32::from(max),
        },
    };
    // One table per channel: a lookup per value instead of a multiply-add and a divide.
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        for (v, slot) in table.iter_mut().enumerate() {
            *slot = (v as f32 * s - norm.mean[c]) / norm.std[c];
        }
    }
    let (r, rest) = out.split_at_mut(pixels);
    let (g, b) = rest.split_at_mut(pixels);
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        r[i] = lut[0][px[0] as usize];
        g[i] = lut[1][px[1] as usize];
        b[i] = lut[2][px[2] as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{Rgb, RgbImage};

    /// The horizontal pass on `Taps` as they are, each sample's own count of weights.
    fn horizontal_row_unpadded(line: &[u8], taps: &Taps, dst: &mut [u8]) {
        for (x, px) in dst.chunks_exact_mut(3).enumerate() {
            let first = taps.first[x] as usize * 3;
            let (mut a0, mut a1, mut a2) = (HALF, HALF, HALF);
            for (k, &w) in taps.weights[x].iter().enumerate() {
                let s = &line[first + k * 3..first + k * 3 + 3];
                a0 += i32::from(s[0]) * w;
                a1 += i32::from(s[1]) * w;
                a2 += i32::from(s[2]) * w;
            }
            px.copy_from_slice(&[clip8(a0), clip8(a1), clip8(a2)]);
        }
    }

    #[test]
    fn padded_taps_give_the_same_bits() {
        // Shrinks by whole and fractional factors (12, 8 and 40 taps), growths, and the
        // edges, where a sample's weights are fewer and the padding moves its start left.
        // The whole shrinks' samples away from the edges are mirrored (summed in pairs),
        // with an even count of taps and, at 5 -> 1 and 9 -> 3, an odd one.
        let mut mirrored_counts = std::collections::BTreeSet::new();
        for (sw, dw) in [
            (1920, 320),
            (1920, 480),
            (4032, 333),
            (400, 10),
            (7, 3),
            (3, 7),
            (1, 5),
            (5, 1),
            (9, 3),
        ] {
            let line: Vec<u8> = (0..sw * 3).map(|i| (i * 97 % 256) as u8).collect();
            let taps = Taps::bilinear(sw as u32, dw as u32);
            let padded = PaddedTaps::of(&taps, sw as u32);
            assert!(padded.first.iter().all(|&f| f + padded.len <= sw));
            if padded.mirrored.iter().any(|&m| m) {
                mirrored_counts.insert(padded.len);
            }
            let (mut want, mut got) = (vec![0u8; dw * 3], vec![1u8; dw * 3]);
            horizontal_row_unpadded(&line, &taps, &mut want);
            horizontal_row(&line, &padded, &mut got);
            assert_eq!(got, want, "{sw} -> {dw}");
        }
        assert!(
            mirrored_counts.iter().any(|k| k % 2 == 0),
            "{mirrored_counts:?}"
        );
        assert!(
            mirrored_counts.iter().any(|k| k % 2 == 1),
            "{mirrored_counts:?}"
        );
    }

    #[test]
    fn max_scale_then_mean_std() {
        let norm = Normalize {
            scale: Scale::ImageMax,
            mean: [0.5, 0.0, 0.0],
            std: [0.5, 1.0, 2.0],
        };
        let rgb = [200u8, 100, 50, 0, 0, 0];
        let mut out = [0f32; 6];
        normalize_into(&rgb, &norm, &mut out);
        // s = 1/200: R plane, G plane, B plane.
        assert_eq!(out, [1.0, -1.0, 0.5, 0.0, 0.125, 0.0]);
    }

    #[test]
    fn fixed_scale_matches_isnet_formula() {
        let norm = Normalize {
            scale: Scale::Fixed(1.0),
            mean: [128.0; 3],
            std: [256.0; 3],
        };
        let mut out = [0f32; 3];
        normalize_into(&[0, 128, 255], &norm, &mut out);
        assert_eq!(out, [-0.5, 0.0, 127.0 / 256.0]);
    }

    #[test]
    fn all_black_image_with_max_scale_does_not_divide_by_zero() {
        let norm = Normalize {
            scale: Scale::ImageMax,
            mean: [0.0; 3],
            std: [1.0; 3],
        };
        let mut out = [1f32; 3];
        normalize_into(&[0, 0, 0], &norm, &mut out);
        assert_eq!(out, [0.0; 3]);
    }

    #[test]
    fn taps_match_pil_for_a_shrink() {
        // PIL: 4 -> 2 at scale 2: support 2, centres 1.0 and 3.0; the first output takes
        // inputs 0..3 with triangle weights 0.75, 0.75, 0.25, normalised by 1.75.
        let taps = Taps::bilinear(4, 2);
        assert_eq!(taps.first, vec![0, 1]);
        let one = f64::from(1u32 << PRECISION_BITS);
        let fixed = |w: f64| (w * one + 0.5) as i32;
        assert_eq!(
            taps.weights[0],
            vec![fixed(3.0 / 7.0), fixed(3.0 / 7.0), fixed(1.0 / 7.0)]
        );
    }

    #[test]
    fn resize_of_uniform_image_is_uniform() {
        let src = RgbImage::from_pixel(37, 23, Rgb([9, 99, 199]));
        let mut out = Vec::new();
        resize_rgb(&src, 8, 5, &mut out);
        assert_eq!(out.len(), 8 * 5 * 3);
        assert!(out.chunks(3).all(|p| p == [9, 99, 199]));
    }

    #[test]
    fn exact16_takes_the_power_of_two_scales_only() {
        // 4x: PIL's weights 1 3 5 7 7 5 3 1 / 32 in 22-bit fixed point.
        let quarter = Taps::bilinear(1920, 480);
        let k = Exact16::of(&quarter.weights[100]).expect("a quarter's kernel is exact");
        assert_eq!(k.weights, vec![1, 3, 5, 7, 7, 5, 3, 1]);
        assert_eq!((k.bias, k.shift), (16, 5));
        // 6x (1920 -> 320): weights / 72 are not multiples of a power of two.
        assert!(Exact16::of(&Taps::bilinear(1920, 320).weights[100]).is_none());
    }

    #[test]
    fn exact16_gives_the_same_bits() {
        // Sizes whose vertical pass takes the 16-bit path (power-of-two ratios, with
        // edges) and some that do not; noise and extremes of each channel.
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for (sw, sh, w, h) in [
            // Power-of-two ratios on both axes (or none on one).
            (1920, 1080, 480, 270),
            (400, 300, 100, 75),
            (256, 64, 128, 64),
            (96, 800, 96, 100),
            // Not a power of two on either axis, or on one of them.
            (1001, 403, 250, 100),
            (640, 480, 320, 320),
        ] {
            let src = RgbImage::from_fn(sw, sh, |x, y| {
                let r = next();
                match (x / 7 + y / 5) % 4 {
                    0 => Rgb([255, 255, 255]),
                    1 => Rgb([0, 0, 0]),
                    _ => Rgb([r as u8, (r >> 8) as u8, (r >> 16) as u8]),
                }
            });
            let (mut want, mut got) = (Vec::new(), Vec::new());
            resize_rgb_with(Lanes::ONE, &src, w, h, false, &mut want);
            resize_rgb_with(Lanes::ONE, &src, w, h, true, &mut got);
            assert!(got == want, "{sw}x{sh} -> {w}x{h}");
        }
    }

    #[test]
    fn lanes_give_the_same_bits() {
        let src = RgbImage::from_fn(401, 257, |x, y| {
            Rgb([(x * 7 + y) as u8, (x ^ y) as u8, (x * y / 3) as u8])
        });
        for (w, h) in [(97, 61), (320, 320), (401, 64), (40, 257)] {
            let mut want = Vec::new();
            resize_rgb(&src, w, h, &mut want);
            for lanes in 2..=4 {
                let mut got = Vec::new();
                resize_rgb_in(Lanes::new(lanes).at_any_size(), &src, w, h, &mut got);
                assert!(got == want, "{w}x{h}, {lanes} lanes");
            }
        }
    }
}
