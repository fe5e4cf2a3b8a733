//! Resampling tables computed on the host and uploaded once per (source size, target
//! size): PIL's 22-bit fixed-point bilinear taps (the preprocess resize), the f64
//! coefficients of fast_image_resize's bilinear convolution (mask and alpha resize), and
//! PIL NEAREST's source indices (trimap resize). Each is flattened to the fixed-stride
//! layout the kernels read: `first[i]`, `count[i]`, then `stride` weights per output.

use crate::pipeline::preprocess::Taps;

/// PIL's fixed-point bilinear taps for one axis, flattened.
#[derive(Debug, Clone, PartialEq)]
pub struct FixedTaps {
    pub first: Vec<u32>,
    pub count: Vec<u32>,
    /// `stride` entries per output sample, zero-padded.
    pub weights: Vec<i32>,
    pub stride: u32,
}

impl FixedTaps {
    /// `Taps::bilinear(in_size, out_size)` (the CPU's own taps) in device layout.
    pub fn bilinear(in_size: u32, out_size: u32) -> Self {
        let taps = Taps::bilinear(in_size, out_size);
        let stride = taps.weights.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut weights = vec![0i32; stride * taps.weights.len()];
        for (dst, w) in weights.chunks_exact_mut(stride).zip(&taps.weights) {
            dst[..w.len()].copy_from_slice(w);
        }
        Self {
            count: taps.weights.iter().map(|w| w.len() as u32).collect(),
            first: taps.first,
            weights,
            stride: stride as u32,
        }
    }

    /// The source rows (or columns) these taps read: `first..end`.
    pub fn span(&self) -> (u32, u32) {
        let first = self.first.first().copied().unwrap_or(0);
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

/// fast_image_resize's convolution coefficients (bilinear, adaptive kernel size, no
/// crop) for one axis, flattened; the port of its `precompute_coefficients`.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvolutionTaps {
    pub first: Vec<u32>,
    pub count: Vec<u32>,
    /// `stride` coefficients per output sample, zero-padded.
    pub coeffs: Vec<f64>,
    pub stride: u32,
}

impl ConvolutionTaps {
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
            coeffs,
            stride: window as u32,
        }
    }

    /// The source rows (or columns) these taps read: `first..end`.
    pub fn span(&self) -> (u32, u32) {
        let first = self.first.first().copied().unwrap_or(0);
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
/// without a GPU: the same loops as `resize_plane_horizontal` / `_vertical`.
pub mod mirror {
    use super::ConvolutionTaps;

    /// Horizontal sum in the four-lane order of `resample.cu`.
    pub fn horizontal_sum(s: &[f32], k: &[f64]) -> f32 {
        let n = k.len();
        let (mut l0, mut l1, mut l2, mut l3) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
        let mut t = 0;
        while t + 8 <= n {
            l0 += f64::from(s[t]) * k[t];
            l1 += f64::from(s[t + 1]) * k[t + 1];
            l2 += f64::from(s[t + 2]) * k[t + 2];
            l3 += f64::from(s[t + 3]) * k[t + 3];
            l0 += f64::from(s[t + 4]) * k[t + 4];
            l1 += f64::from(s[t + 5]) * k[t + 5];
            l2 += f64::from(s[t + 6]) * k[t + 6];
            l3 += f64::from(s[t + 7]) * k[t + 7];
            t += 8;
        }
        if t + 4 <= n {
            l0 += f64::from(s[t]) * k[t];
            l1 += f64::from(s[t + 1]) * k[t + 1];
            l2 += f64::from(s[t + 2]) * k[t + 2];
            l3 += f64::from(s[t + 3]) * k[t + 3];
            t += 4;
        }
        if t + 2 <= n {
            l0 += f64::from(s[t]) * k[t];
            l1 += f64::from(s[t + 1]) * k[t + 1];
            t += 2;
        }
        if t < n {
            l0 += f64::from(s[t]) * k[t];
        }
        ((l0 + l2) + (l1 + l3)) as f32
    }

    /// The whole two-pass resize of a `w` x `h` plane to `dw` x `dh`.
    pub fn resize_plane(src: &[f32], w: u32, h: u32, dw: u32, dh: u32) -> Vec<f32> {
        let horiz = ConvolutionTaps::bilinear(w, dw);
        let vert = ConvolutionTaps::bilinear(h, dh);
        let (row0, row_end) = vert.span();
        let (w, dw) = (w as usize, dw as usize);
        let mut tmp = vec![0f32; dw * (row_end - row0) as usize];
        for (r, line) in tmp.chunks_exact_mut(dw).enumerate() {
            let src_row = &src[(row0 as usize + r) * w..][..w];
            for (x, out) in line.iter_mut().enumerate() {
                let f = horiz.first[x] as usize;
                let n = horiz.count[x] as usize;
                let k = &horiz.coeffs[x * horiz.stride as usize..][..n];
                *out = horizontal_sum(&src_row[f..f + n], k);
            }
        }
        let mut out = vec![0f32; dw * dh as usize];
        for (y, line) in out.chunks_exact_mut(dw).enumerate() {
            let f = (vert.first[y] - row0) as usize;
            let k = &vert.coeffs[y * vert.stride as usize..][..vert.count[y] as usize];
            for (x, o) in line.iter_mut().enumerate() {
                let mut sum = 0.0f64;
                for (t, &kt) in k.iter().enumerate() {
                    sum += f64::from(tmp[(f + t) * dw + x]) * kt;
                }
                *o = sum as f32;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::plane::Plane;
    use crate::pipeline::resample;
    use fast_image_resize::Resizer;
    use image::GrayImage;

    fn pattern(w: u32, h: u32) -> Vec<f32> {
        (0..w * h)
            .map(|k| ((k.wrapping_mul(2_654_435_761) >> 7) % 1000) as f32 / 999.0)
            .collect()
    }

    #[test]
    fn convolution_mirror_equals_fast_image_resize() {
        // The CPU stage picks AVX2 on x86-64 when it can; the mirror follows that order,
        // so it is exact there. Elsewhere the sum order differs: 1 ulp is allowed.
        let exact = cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx2");
        for (w, h, dw, dh) in [
            (320, 320, 1021, 767),
            (320, 320, 97, 51),
            (7, 5, 3, 2),
            (1, 1, 13, 9),
            (33, 17, 1, 1),
            (64, 64, 64, 64),
            (320, 320, 320, 1000),
            (1000, 9, 31, 9),
        ] {
            let src = pattern(w, h);
            let cpu =
                resample::resize_plane(&mut Resizer::new(), &Plane::new(w, h, src.clone()), dw, dh)
                    .unwrap();
            let mine = mirror::resize_plane(&src, w, h, dw, dh);
            for (i, (a, b)) in mine.iter().zip(&cpu.data).enumerate() {
                let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
                if exact {
                    assert_eq!(a, b, "{w}x{h}->{dw}x{dh} at {i}");
                } else {
                    assert!(ulps <= 1, "{w}x{h}->{dw}x{dh} at {i}: {a} vs {b}");
                }
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
