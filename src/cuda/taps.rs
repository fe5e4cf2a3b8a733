//! Resampling tables computed on the host and uploaded once per (source size, target
//! size): PIL's 22-bit fixed-point bilinear taps (the preprocess resize and the guided
//! filter's guide), the coefficients of fast_image_resize's bilinear convolution (mask
//! and alpha resize: computed in f64 as the CPU's, uploaded rounded to f32, which the
//! kernels compute in), PIL's bilinear weights in f32 (the guided filter's model
//! upsampled to the source) and PIL NEAREST's source indices (trimap resize). Each is
//! flattened to the fixed-stride layout the kernels read: `first[i]`, `count[i]`, then
//! `stride` weights per output.

use crate::stages::preprocess::{bilinear_weights, Taps};

/// One axis of resampling taps in the layout the kernels read: for output sample `i`,
/// `count[i]` weights from `weights[i * stride]`, applied to the inputs from `first[i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatTaps<W> {
    pub first: Vec<u32>,
    pub count: Vec<u32>,
    /// `stride` entries per output sample, zero-padded.
    pub weights: Vec<W>,
    pub stride: u32,
}

impl<W: Copy + Default> FlatTaps<W> {
    /// Flattens `(first input, weights)` per output sample.
    fn from_rows(rows: &[(u32, Vec<W>)]) -> Self {
        let stride = rows.iter().map(|(_, w)| w.len()).max().unwrap_or(0).max(1);
        let mut weights = vec![W::default(); stride * rows.len()];
        for (dst, (_, w)) in weights.chunks_exact_mut(stride).zip(rows) {
            dst[..w.len()].copy_from_slice(w);
        }
        Self {
            first: rows.iter().map(|(f, _)| *f).collect(),
            count: rows.iter().map(|(_, w)| w.len() as u32).collect(),
            weights,
            stride: stride as u32,
        }
    }

    /// The source samples these taps read: `first..end`.
    pub fn span(&self) -> (u32, u32) {
        let first = self.first.iter().copied().min().unwrap_or(0);
        let end = self
            .first
            .iter()
            .zip(&self.count)
            .map(|(f, n)| f + n)
            .max()
            .unwrap_or(first);
        (first, end)
    }
}

/// PIL's fixed-point bilinear taps (the preprocess resize and the guided filter's guide).
pub type FixedTaps = FlatTaps<i32>;

impl FlatTaps<i32> {
    /// `Taps::bilinear(in_size, out_size)` (the CPU's own taps) in device layout.
    pub fn bilinear(in_size: u32, out_size: u32) -> Self {
        let taps = Taps::bilinear(in_size, out_size);
        let rows: Vec<(u32, Vec<i32>)> = taps.first.into_iter().zip(taps.weights).collect();
        Self::from_rows(&rows)
    }
}

/// The guided filter's upsampling taps for one axis (`LinearModel::alpha`): PIL's
/// bilinear weights from `bilinear_weights`, cast to f32 as the CPU does before it
/// multiplies, every tap kept (zero weights included, as the CPU multiplies them too).
pub type UpsampleTaps = FlatTaps<f32>;

impl FlatTaps<f32> {
    pub fn bilinear(in_size: u32, out_size: u32) -> Self {
        let rows: Vec<(u32, Vec<f32>)> = bilinear_weights(in_size, out_size)
            .into_iter()
            .map(|(first, w)| (first, w.into_iter().map(|v| v as f32).collect()))
            .collect();
        Self::from_rows(&rows)
    }
}

/// fast_image_resize's convolution coefficients (bilinear, adaptive kernel size, no
/// crop) for one axis; the port of its `precompute_coefficients`. Its stride is the
/// filter window, as in the original, not the longest row.
pub type ConvolutionTaps = FlatTaps<f64>;

impl FlatTaps<f64> {
    pub fn bilinear(in_size: u32, out_size: u32) -> Self {
        let scale = f64::from(in_size) / f64::from(out_size);
        let filter_scale = scale.max(1.0);
        let filter_radius = filter_scale; // bilinear support is 1
        let window = filter_radius.ceil() as usize * 2 + 1;
        let recip_filter_scale = 1.0 / filter_scale;
        let mut first = Vec::with_capacity(out_size as usize);
        let mut count = Vec::with_capacity(out_size as usize);
        let mut coeffs: Vec<f64> = Vec::with_capacity(window * out_size as usize);
        for out_x in 0..out_size {
            let in_center = (f64::from(out_x) + 0.5) * scale;
            let x_min = (in_center - filter_radius).floor().max(0.) as u32;
            let x_max = (in_center + filter_radius).ceil().min(f64::from(in_size)) as u32;
            let cur = coeffs.len();
            let mut ww = 0.0f64;
            let center = in_center - 0.5;
            let mut bound_start = x_min;
            let mut bound_end = x_max;
            for x in x_min..x_max {
                let t = ((f64::from(x) - center) * recip_filter_scale).abs();
                let w = if t < 1.0 { 1.0 - t } else { 0.0 };
                if x == bound_start && w == 0. {
                    bound_start += 1;
                } else {
                    coeffs.push(w);
                    ww += w;
                }
            }
            // Trailing zero weights are dropped (the scan runs over the whole vector,
            // as the original does, and stops at the first non-zero).
            for &c in coeffs.iter().rev() {
                if bound_end <= bound_start || c != 0. {
                    break;
                }
                bound_end -= 1;
            }
            if ww != 0.0 {
                coeffs[cur..].iter_mut().for_each(|w| *w /= ww);
            }
            coeffs.resize(cur + window, 0.);
            // The kernels read exactly `count` coefficients from `cur`.
            first.push(bound_start);
            count.push(bound_end - bound_start);
        }
        Self {
            first,
            count,
            weights: coeffs,
            stride: window as u32,
        }
    }
}

impl FlatTaps<f64> {
    /// The same taps with each coefficient rounded to f32: what the plane resize's
    /// kernels read (they compute in f32; `resample.cu` says what that costs).
    pub fn to_f32(&self) -> FlatTaps<f32> {
        FlatTaps {
            first: self.first.clone(),
            count: self.count.clone(),
            weights: self.weights.iter().map(|&w| w as f32).collect(),
            stride: self.stride,
        }
    }
}

/// PIL NEAREST's source index for each of `dst` samples along an axis of `src`: the
/// running f64 sum of src/dst from half a step, truncated (as `resample::resize_nearest`).
pub fn nearest_indices(src: u32, dst: u32) -> Vec<u32> {
    let step = f64::from(src) / f64::from(dst);
    let mut at = 0.5 * step;
    (0..dst)
        .map(|_| {
            let i = (at as u32).min(src.saturating_sub(1));
            at += step;
            i
        })
        .collect()
}

/// The kernels' arithmetic on the CPU, for testing the tables and the summation order
/// without a GPU: the same loops as `resize_plane_horizontal` / `_vertical` and
/// `guided_alpha`.
pub mod mirror {
    use super::{ConvolutionTaps, UpsampleTaps};
    use crate::stages::guided_filter::LinearModel;
    use crate::stages::trimap::{BACKGROUND, FOREGROUND};

    /// `model_alpha` (composite.cu) on the CPU before quantisation: `q` at every pixel
    /// of `rgb` (`w` x `h`). For each horizontal tap the vertical sum of that column,
    /// then the horizontal sum, both in f32 from 0 in tap order; then `a * luma + b`.
    pub fn guided_q(model: &LinearModel, rgb: &[u8], w: u32, h: u32) -> Vec<f32> {
        let (lw, lh) = (model.mean_a.width, model.mean_a.height);
        let xs = UpsampleTaps::bilinear(lw, w);
        let ys = UpsampleTaps::bilinear(lh, h);
        let lw = lw as usize;
        let mut q = Vec::with_capacity(w as usize * h as usize);
        for y in 0..h as usize {
            let (y0, ny) = (ys.first[y] as usize, ys.count[y] as usize);
            let wy = &ys.weights[y * ys.stride as usize..][..ny];
            for x in 0..w as usize {
                let (x0, nx) = (xs.first[x] as usize, xs.count[x] as usize);
                let wx = &xs.weights[x * xs.stride as usize..][..nx];
                let (mut a, mut b) = (0f32, 0f32);
                for (ix, &wi) in wx.iter().enumerate() {
                    let (mut row_a, mut row_b) = (0f32, 0f32);
                    for (j, &wj) in wy.iter().enumerate() {
                        let k = (y0 + j) * lw + x0 + ix;
                        row_a += wj * model.mean_a.data[k];
                        row_b += wj * model.mean_b.data[k];
                    }
                    a += wi * row_a;
                    b += wi * row_b;
                }
                let p = &rgb[3 * (y * w as usize + x)..][..3];
                let luma =
                    (0.299 * f32::from(p[0]) + 0.587 * f32::from(p[1]) + 0.114 * f32::from(p[2]))
                        / 255.0;
                q.push(a * luma + b);
            }
        }
        q
    }

    /// `guided_alpha` (composite.cu) on the CPU: certain trimap values decide, elsewhere
    /// `guided_q` quantised as the composite does.
    pub fn guided_alpha(model: &LinearModel, rgb: &[u8], trimap: &[u8], w: u32, h: u32) -> Vec<u8> {
        guided_q(model, rgb, w, h)
            .iter()
            .zip(trimap)
            .map(|(&q, &t)| match t {
                FOREGROUND => 255,
                BACKGROUND => 0,
                _ => (q.clamp(0.0, 1.0) * 255.0).round() as u8,
            })
            .collect()
    }

    /// Horizontal sum in the four-lane order of `resample.cu`, in f32 as the kernel.
    pub fn horizontal_sum(s: &[f32], k: &[f32]) -> f32 {
        let n = k.len();
        let (mut l0, mut l1, mut l2, mut l3) = (0f32, 0f32, 0f32, 0f32);
        let mut t = 0;
        while t + 8 <= n {
            l0 += s[t] * k[t];
            l1 += s[t + 1] * k[t + 1];
            l2 += s[t + 2] * k[t + 2];
            l3 += s[t + 3] * k[t + 3];
            l0 += s[t + 4] * k[t + 4];
            l1 += s[t + 5] * k[t + 5];
            l2 += s[t + 6] * k[t + 6];
            l3 += s[t + 7] * k[t + 7];
            t += 8;
        }
        if t + 4 <= n {
            l0 += s[t] * k[t];
            l1 += s[t + 1] * k[t + 1];
            l2 += s[t + 2] * k[t + 2];
            l3 += s[t + 3] * k[t + 3];
            t += 4;
        }
        if t + 2 <= n {
            l0 += s[t] * k[t];
            l1 += s[t + 1] * k[t + 1];
            t += 2;
        }
        if t < n {
            l0 += s[t] * k[t];
        }
        (l0 + l2) + (l1 + l3)
    }

    /// How far the kernels' f32 resize of a `w` x `h` plane whose values are at most
    /// `max_abs` in size may be from the CPU's f64 one at `dw` x `dh`, by construction:
    /// a pass of n taps (non-negative coefficients summing to 1) rounds each coefficient
    /// to f32, each product, and at most n - 1 sums on any tap's way to the result, so it
    /// is within (n + 1) 2^-24 max|s| of the exact f64 sum; the CPU rounds that sum to
    /// f32 once (2^-24 max|s|). The vertical pass adds its own (n_v + 1) and the CPU's
    /// rounding, and carries the horizontal one: (n_h + n_v + 4) 2^-24 max|s| in all
    /// (0.1% more for the products of the roundings). With at most 3 taps upscaling,
    /// 10 x 2^-24 = 6e-7: an 8-bit quantisation of the result moves by at most 1 LSB,
    /// and only where the value is that close to a rounding boundary.
    pub fn resize_bound(w: u32, h: u32, dw: u32, dh: u32, max_abs: f32) -> f32 {
        let taps = |src, dst| {
            let taps = ConvolutionTaps::bilinear(src, dst);
            taps.count.iter().copied().max().unwrap_or(0)
        };
        let roundings = taps(w, dw) + taps(h, dh) + 4;
        roundings as f32 * f32::EPSILON / 2.0 * max_abs * 1.001
    }

    /// The whole two-pass resize of a `w` x `h` plane to `dw` x `dh`, in f32 with the
    /// coefficients rounded to f32, as the kernels compute it.
    pub fn resize_plane(src: &[f32], w: u32, h: u32, dw: u32, dh: u32) -> Vec<f32> {
        let horiz = ConvolutionTaps::bilinear(w, dw).to_f32();
        let vert = ConvolutionTaps::bilinear(h, dh).to_f32();
        let (row0, row_end) = vert.span();
        let (w, dw) = (w as usize, dw as usize);
        let mut tmp = vec![0f32; dw * (row_end - row0) as usize];
        for (r, line) in tmp.chunks_exact_mut(dw).enumerate() {
            let src_row = &src[(row0 as usize + r) * w..][..w];
            for (x, out) in line.iter_mut().enumerate() {
                let f = horiz.first[x] as usize;
                let n = horiz.count[x] as usize;
                let k = &horiz.weights[x * horiz.stride as usize..][..n];
                *out = horizontal_sum(&src_row[f..f + n], k);
            }
        }
        let mut out = vec![0f32; dw * dh as usize];
        for (y, line) in out.chunks_exact_mut(dw).enumerate() {
            let f = (vert.first[y] - row0) as usize;
            let k = &vert.weights[y * vert.stride as usize..][..vert.count[y] as usize];
            for (x, o) in line.iter_mut().enumerate() {
                let mut sum = 0f32;
                for (t, &kt) in k.iter().enumerate() {
                    sum += tmp[(f + t) * dw + x] * kt;
                }
                *o = sum;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stages::lanes::Lanes;
    use crate::stages::plane::Plane;
    use crate::stages::resample;
    use fast_image_resize::Resizer;
    use image::GrayImage;

    fn pattern(w: u32, h: u32) -> Vec<f32> {
        (0..w * h)
            .map(|k| ((k.wrapping_mul(2_654_435_761) >> 7) % 1000) as f32 / 999.0)
            .collect()
    }

    /// Planes that stress the f32 resize: texture in [0, 1], a hard 0/1 edge across
    /// both axes, a large flat area, and values beyond [0, 1] (a model's raw output).
    fn stress_planes(w: u32, h: u32) -> Vec<(&'static str, Vec<f32>)> {
        let edge = (0..w * h)
            .map(|k| f32::from(u8::from((k % w < w / 2) != (k / w < h / 2))))
            .collect();
        vec![
            ("texture", pattern(w, h)),
            ("edge", edge),
            ("flat", vec![0.7; (w * h) as usize]),
            (
                "beyond",
                pattern(w, h).iter().map(|v| v * 3.0 - 1.0).collect(),
            ),
        ]
    }

    #[test]
    fn convolution_mirror_is_held_to_fast_image_resize() {
        // The kernels' f32 arithmetic (the mirror's) against the CPU's f64, within
        // `mirror::resize_bound` (its doc derives it from the roundings, not from these
        // runs). Measured here (x86-64 with AVX2): at most 3 x 2^-24 on the texture, the
        // edges and the flat planes, whatever the scale (the 4032 taps of 4032 -> 1
        // included), and 6 x 2^-24 on values in [-1, 2]; the bound is 2.7 to 1000 times
        // that (most for many taps, whose rounding errors mostly cancel).
        let mut report = Vec::new();
        for [w, h, dw, dh] in [
            // Up and down by uneven ratios.
            [320, 320, 1021, 767],
            [320, 320, 97, 51],
            [7, 5, 3, 2],
            // One-pixel sides, then the identity.
            [1, 1, 13, 9],
            [33, 17, 1, 1],
            [64, 64, 64, 64],
            // One axis only.
            [320, 320, 320, 1000],
            [1000, 9, 31, 9],
            // The extremes served: a 320 mask to 12 MP and back, and 4032 taps.
            [320, 320, 4032, 3024],
            [4032, 3024, 320, 320],
            [4032, 7, 1, 7],
        ] {
            for (name, src) in stress_planes(w, h) {
                let cpu = resample::resize_plane(
                    &mut Resizer::new(),
                    &Plane::new(w, h, src.clone()),
                    dw,
                    dh,
                )
                .unwrap();
                let mine = mirror::resize_plane(&src, w, h, dw, dh);
                let max_abs = src.iter().fold(0f32, |m, v| m.max(v.abs()));
                let bound = mirror::resize_bound(w, h, dw, dh, max_abs);
                let worst = mine
                    .iter()
                    .zip(&cpu.data)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                report.push(format!(
                    "{w}x{h}->{dw}x{dh} {name}: {:.1} x 2^-24 (bound {:.1})",
                    worst / f32::EPSILON * 2.0,
                    bound / f32::EPSILON * 2.0
                ));
                assert!(worst <= bound, "{}", report.last().unwrap());
            }
        }
        println!("{}", report.join("\n"));
    }

    /// A textured RGB8 image and a mask at another size, for the guided filter.
    fn guided_case(w: u32, h: u32, mw: u32, mh: u32) -> (image::RgbImage, Plane, GrayImage) {
        let image = image::RgbImage::from_fn(w, h, |x, y| {
            let v = (x.wrapping_mul(73_856_093) ^ y.wrapping_mul(19_349_663))
                .wrapping_mul(2_654_435_761);
            image::Rgb([(v >> 24) as u8, (v >> 16) as u8, ((x * 255) / w) as u8])
        });
        // Values beyond [0, 1] too: `fit` clamps them.
        let mask = Plane::new(
            mw,
            mh,
            pattern(mw, mh).iter().map(|v| v * 1.4 - 0.2).collect(),
        );
        let trimap = GrayImage::from_fn(w, h, |x, y| {
            image::Luma([[0u8, 128, 255, 128][((x / 3 + y / 2) % 4) as usize]])
        });
        (image, mask, trimap)
    }

    #[test]
    fn upsample_taps_are_the_cpu_weights_in_f32() {
        for (lw, w) in [(1, 1), (1, 7), (3, 9), (17, 17), (101, 403), (5, 3)] {
            let taps = UpsampleTaps::bilinear(lw, w);
            let cpu = bilinear_weights(lw, w);
            assert_eq!(taps.first.len(), w as usize);
            for (i, (first, weights)) in cpu.iter().enumerate() {
                assert_eq!(taps.first[i], *first);
                assert_eq!(taps.count[i] as usize, weights.len());
                let row = &taps.weights[i * taps.stride as usize..][..weights.len()];
                let want: Vec<f32> = weights.iter().map(|&v| v as f32).collect();
                assert_eq!(row, want.as_slice(), "{lw} -> {w} at {i}");
            }
            let (start, end) = taps.span();
            assert!(start == 0 && end <= lw, "{lw} -> {w}: reads {start}..{end}");
        }
        // Scale 1 (subsample 1): each output reads its own sample with weight 1 first.
        let id = UpsampleTaps::bilinear(9, 9);
        for i in 0..9 {
            assert_eq!(id.first[i] as usize, i);
            assert_eq!(id.weights[i * id.stride as usize], 1.0);
            assert!(
                id.weights[i * id.stride as usize + 1..][..id.count[i] as usize - 1]
                    .iter()
                    .all(|&v| v == 0.0)
            );
        }
    }

    #[test]
    fn guided_alpha_mirror_is_linear_model_alpha_bit_for_bit() {
        use crate::stages::guided_filter;
        for (w, h, mw, mh) in [
            (1, 1, 1, 1),
            (7, 5, 3, 2),
            (33, 17, 10, 10),
            (64, 48, 320, 320),
            (101, 3, 20, 20),
        ] {
            let (image, mask, trimap) = guided_case(w, h, mw, mh);
            for subsample in [1, 2, 3, 4] {
                let model = guided_filter::fit(
                    Lanes::ONE,
                    &mut Resizer::new(),
                    &image,
                    &mask,
                    8,
                    1e-3,
                    subsample,
                )
                .unwrap();
                let want = model.alpha(Lanes::ONE, &image, &trimap);
                let got = mirror::guided_alpha(&model, image.as_raw(), trimap.as_raw(), w, h);
                assert_eq!(&got, want.as_raw(), "{w}x{h} subsample {subsample}");
                // Before quantisation: the mirror's q is `apply`'s to the bit.
                let q = model.apply(&guided_filter::luma(image.as_raw(), w, h));
                let got = mirror::guided_q(&model, image.as_raw(), w, h);
                let differ = got
                    .iter()
                    .zip(&q.data)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differ, 0, "{w}x{h} subsample {subsample}: q differs");
            }
        }
    }

    #[test]
    fn nearest_indices_reproduce_resize_nearest() {
        for (w, h, dw, dh) in [
            (320, 320, 4032, 3024),
            (3, 2, 5, 7),
            (1, 1, 9, 4),
            (9, 9, 2, 3),
        ] {
            let src =
                GrayImage::from_fn(w, h, |x, y| image::Luma([((x * 7 + y * 13) % 251) as u8]));
            let cpu = resample::resize_nearest(&src, dw, dh);
            let xs = nearest_indices(w, dw);
            let ys = nearest_indices(h, dh);
            let src = &src;
            let mine: Vec<u8> = ys
                .iter()
                .flat_map(|&y| xs.iter().map(move |&x| src.get_pixel(x, y)[0]))
                .collect();
            assert_eq!(&mine, cpu.as_raw(), "{w}x{h}->{dw}x{dh}");
        }
    }

    #[test]
    fn fixed_taps_keep_the_cpu_weights_and_span() {
        let taps = FixedTaps::bilinear(4032, 320);
        let cpu = Taps::bilinear(4032, 320);
        assert_eq!(taps.first, cpu.first);
        for (i, w) in cpu.weights.iter().enumerate() {
            assert_eq!(taps.count[i] as usize, w.len());
            let row = &taps.weights[i * taps.stride as usize..][..w.len()];
            assert_eq!(row, w.as_slice());
        }
        let (start, end) = taps.span();
        assert_eq!(start, 0);
        assert!(end <= 4032);
        // Identity taps (same size) read exactly one sample of weight 1.0 each.
        let id = FixedTaps::bilinear(17, 17);
        assert!(id
            .count
            .iter()
            .zip(&id.first)
            .enumerate()
            .all(|(i, (&n, &f))| {
                f as usize == i && id.weights[i * id.stride as usize] == 1 << 22 && n >= 1
            }));
    }
}
