//! Matting by guided filter (He, Sun and Tang, "Guided Image Filtering", 2010/2013): the
//! coarse mask is filtered with the image's luma as the guide, so the alpha follows the
//! image's edges (hair, fur) instead of the model's 320-pixel grid. The fast variant (He
//! and Sun, 2015) fits the filter's linear coefficients at 1/s of the source size and
//! applies them at full size: s^2 less work for the same edges. Box means run as running
//! sums, O(1) per pixel whatever the radius.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use fast_image_resize::Resizer;
use image::GrayImage;

use super::composite::unit_to_u8;
use super::lanes::Lanes;
use super::plane::Plane;
use super::preprocess::{bilinear_weights, resize_rgb_in};
use super::resample::resize_plane_into;
use super::trimap::{BACKGROUND, FOREGROUND};
use super::{Bytes, Rgb8, StageError};

/// Luma in [0, 1] (BT.601 weights) of one RGB8 pixel: the filter's guide.
fn luma_of(p: &[u8]) -> f32 {
    (0.299 * f32::from(p[0]) + 0.587 * f32::from(p[1]) + 0.114 * f32::from(p[2])) / 255.0
}

/// The luma plane of interleaved RGB8.
pub fn luma(rgb: &[u8], width: u32, height: u32) -> Plane {
    Plane::new(width, height, rgb.chunks_exact(3).map(luma_of).collect())
}

/// The buffers a fit works in, kept from one image to the next (a replica keeps one).
/// Made afresh for each 12 MP photo, they were memory the allocator had not used yet,
/// and on this project's VMs the kernel's first write of fresh memory came in bursts
/// that took up to half of both cores while admitted requests waited on them
/// (docs/decisions.md, "Memory kept between requests"). Each buffer grows to the
/// largest image fitted and stays that size.
#[derive(Debug, Default)]
pub struct Scratch {
    /// Planes not in use, lent again by `plane`.
    spare: Vec<Vec<f32>>,
    /// The image at the fit's size.
    small: Vec<u8>,
    /// The box filter's horizontal sums and running column sums.
    row_sums: Vec<f32>,
    column_acc: Vec<f64>,
}

/// The most spare planes a `Scratch` keeps: a fit has ten in use at once.
const SPARE_PLANES: usize = 12;

/// A replica's `Scratch`, on the shelf every replica's is on, so that a server gone idle
/// can give their buffers back (`release_kept_scratch`) as it gives back its other
/// memory: kept for good, a fit at full size on two replicas left 343 MB of a 391 MB
/// peak resident after a burst of 1080p photos (`tests/hosting.rs`'s idle test).
#[derive(Debug)]
pub struct KeptScratch(Arc<Mutex<Scratch>>);

fn shelf() -> MutexGuard<'static, Vec<Weak<Mutex<Scratch>>>> {
    static SHELF: OnceLock<Mutex<Vec<Weak<Mutex<Scratch>>>>> = OnceLock::new();
    // A list of weak references stays consistent whatever panicked while it was held.
    SHELF
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

impl Default for KeptScratch {
    fn default() -> Self {
        let scratch = Arc::new(Mutex::new(Scratch::default()));
        let mut shelf = shelf();
        shelf.retain(|s| s.strong_count() > 0);
        shelf.push(Arc::downgrade(&scratch));
        Self(scratch)
    }
}

impl KeptScratch {
    /// The scratch, for one fit.
    pub fn lock(&self) -> MutexGuard<'_, Scratch> {
        // Buffers are written before they are read: a fit that panicked leaves nothing
        // the next one reads.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Gives back the buffers of every replica's `Scratch` not in use now (the server has
/// gone idle); each grows again with its next fit.
pub fn release_kept_scratch() {
    let scratches: Vec<_> = shelf().iter().filter_map(Weak::upgrade).collect();
    let mut bytes = 0;
    for scratch in scratches {
        if let Ok(mut s) = scratch.try_lock() {
            bytes += s.bytes();
            *s = Scratch::default();
        }
    }
    if bytes > 0 {
        tracing::debug!(bytes, "the guided filter's kept buffers given back");
    }
}

/// A plane of `len` zeros, from one of `spare` where there is one.
fn lend(spare: &mut Vec<Vec<f32>>, len: usize) -> Vec<f32> {
    let mut plane = spare.pop().unwrap_or_default();
    plane.clear();
    plane.resize(len, 0.0);
    plane
}

impl Scratch {
    /// A plane of `len` zeros, from a spare one where there is one.
    fn plane(&mut self, len: usize) -> Vec<f32> {
        lend(&mut self.spare, len)
    }

    /// Keeps `plane` to lend again.
    fn keep(&mut self, plane: Vec<f32>) {
        if self.spare.len() < SPARE_PLANES {
            self.spare.push(plane);
        }
    }

    /// Keeps a fitted model's planes once its alpha is made.
    pub fn keep_model(&mut self, model: LinearModel) {
        self.keep(model.mean_a.data);
        self.keep(model.mean_b.data);
    }

    /// The bytes its buffers hold.
    fn bytes(&self) -> usize {
        let planes: usize = self.spare.iter().map(Vec::capacity).sum();
        4 * (planes + self.row_sums.capacity())
            + 8 * self.column_acc.capacity()
            + self.small.capacity()
    }
}

/// The guided filter's local linear model `q = A * I + B`, with `A` and `B` (the box
/// means of the coefficients) at the resolution they were fitted at.
#[derive(Debug, Clone)]
pub struct LinearModel {
    pub mean_a: Plane,
    pub mean_b: Plane,
}

/// Fits the fast guided filter of the coarse mask `coarse` (any size) to `image`: the
/// mask and the image (PIL-exact u8 bilinear, then luma) are resized to
/// `ceil(size / subsample)` and the coefficients fitted there with radius
/// `radius / subsample` (rounded half up, at least 1). `subsample` 1 is the classic
/// filter at full size. No full-size plane is made: the full-size luma is only needed
/// where the trimap is unknown, and `LinearModel::alpha` computes it there. The image's
/// resize splits its rows across `lanes` (the same bits for any number).
pub fn fit(
    lanes: Lanes,
    resizer: &mut Resizer,
    image: &Rgb8<impl Bytes>,
    coarse: &Plane,
    radius: u32,
    epsilon: f32,
    subsample: u32,
) -> Result<LinearModel, StageError> {
    let scratch = &mut Scratch::default();
    fit_in(
        lanes, resizer, scratch, image, coarse, radius, epsilon, subsample,
    )
}

/// `fit`, working in `scratch`'s buffers (the model's planes are lent from it too:
/// `Scratch::keep_model` takes them back).
#[allow(clippy::too_many_arguments)]
pub fn fit_in(
    lanes: Lanes,
    resizer: &mut Resizer,
    scratch: &mut Scratch,
    image: &Rgb8<impl Bytes>,
    coarse: &Plane,
    radius: u32,
    epsilon: f32,
    subsample: u32,
) -> Result<LinearModel, StageError> {
    let s = subsample.max(1);
    let (w, h) = (image.width().div_ceil(s), image.height().div_ceil(s));
    let r = ((radius + s / 2) / s).max(1);
    let plane = w as usize * h as usize;
    let mut p = resize_plane_into(resizer, coarse, w, h, scratch.plane(plane))?;
    p.data.iter_mut().for_each(|v| *v = v.clamp(0.0, 1.0));
    let mut guide = Plane::new(w, h, scratch.plane(plane));
    let rgb: &[u8] = if s > 1 {
        let mut small = std::mem::take(&mut scratch.small);
        resize_rgb_in(lanes, image, w, h, &mut small);
        scratch.small = small;
        &scratch.small
    } else {
        image.as_raw()
    };
    for (g, px) in guide.data.iter_mut().zip(rgb.chunks_exact(3)) {
        *g = luma_of(px);
    }
    let (mean_a, mean_b) = coefficients(scratch, &guide, &p, r, epsilon);
    scratch.keep(p.data);
    scratch.keep(guide.data);
    Ok(LinearModel { mean_a, mean_b })
}

impl LinearModel {
    /// `q = A * I + B` at every pixel of `guide`, `A` and `B` bilinearly upsampled (PIL's
    /// mode-F bilinear).
    pub fn apply(&self, guide: &Plane) -> Plane {
        let mut q = vec![0f32; guide.len()];
        let (w, h) = (guide.width, guide.height);
        self.for_each_pixel(
            w,
            h,
            0..h as usize,
            None,
            |k| guide.data[k],
            |k, v| q[k] = v,
        );
        Plane::new(w, h, q)
    }

    /// Alpha in u8 at the guide's size: 255 and 0 where the trimap is certain, the model
    /// where it is unknown. Only unknown pixels are evaluated: the band is typically a
    /// tenth of the image, and upsampling `A` and `B` everywhere cost more than the fit.
    /// Its rows are split across `lanes` (the same bits for any number).
    pub fn alpha(&self, lanes: Lanes, image: &Rgb8<impl Bytes>, trimap: &GrayImage) -> GrayImage {
        let (w, h) = image.dimensions();
        let mut alpha = vec![0; trimap.as_raw().len()];
        self.alpha_into(lanes, image, trimap.as_raw(), &mut alpha);
        GrayImage::from_raw(w, h, alpha).expect("length is width * height")
    }

    /// `alpha`, written into `alpha` (the image's size; every byte is written) from the
    /// trimap's bytes `t`.
    pub fn alpha_into(&self, lanes: Lanes, image: &Rgb8<impl Bytes>, t: &[u8], alpha: &mut [u8]) {
        let rgb = image.as_raw();
        let (w, h) = image.dimensions();
        let row_len = w as usize;
        for (a, &v) in alpha.iter_mut().zip(t) {
            *a = if v == FOREGROUND { 255 } else { 0 };
        }
        lanes.rows(alpha, row_len, |first_row, rows| {
            let offset = first_row * row_len;
            self.for_each_pixel(
                w,
                h,
                first_row..first_row + rows.len() / row_len.max(1),
                Some(t),
                |k| luma_of(&rgb[3 * k..3 * k + 3]),
                |k, v| rows[k - offset] = unit_to_u8(v),
            );
        });
    }

    /// Calls `out(index, q)` for each pixel `index` in rows `rows` of the `width` x
    /// `height` plane, with the guide's value there from `guide(index)`: every pixel, or
    /// with a `trimap` of that size only those it leaves unknown. Rows with no such
    /// pixel skip the vertical interpolation; spans of `SPAN` pixels with none are
    /// skipped whole (a test of the span that vectorises, where a test per pixel
    /// dominated: the band is a tenth of the pixels).
    fn for_each_pixel(
        &self,
        width: u32,
        height: u32,
        rows: std::ops::Range<usize>,
        trimap: Option<&[u8]>,
        guide: impl Fn(usize) -> f32,
        mut out: impl FnMut(usize, f32),
    ) {
        const SPAN: usize = 32;
        let (w, h) = (width as usize, height as usize);
        let lw = self.mean_a.width as usize;
        let xs = FlatTaps::new(&bilinear_weights(self.mean_a.width, width));
        let ys = bilinear_weights(self.mean_a.height, height);
        let (mut row_a, mut row_b) = (vec![0f32; lw], vec![0f32; lw]);
        for (y, (y0, wy)) in ys.iter().enumerate().take(h.min(rows.end)).skip(rows.start) {
            let row_trimap = trimap.map(|t| &t[y * w..(y + 1) * w]);
            if row_trimap.is_some_and(|r| !any_unknown(r)) {
                continue;
            }
            // Vertical interpolation of the low-resolution rows, then horizontal per pixel.
            row_a.iter_mut().for_each(|v| *v = 0.0);
            row_b.iter_mut().for_each(|v| *v = 0.0);
            for (j, &wj) in wy.iter().enumerate() {
                let src = (*y0 as usize + j) * lw;
                let wj = wj as f32;
                for x in 0..lw {
                    row_a[x] += wj * self.mean_a.data[src + x];
                    row_b[x] += wj * self.mean_b.data[src + x];
                }
            }
            for start in (0..w).step_by(SPAN) {
                let end = (start + SPAN).min(w);
                if row_trimap.is_some_and(|r| !any_unknown(&r[start..end])) {
                    continue;
                }
                for x in start..end {
                    if row_trimap.is_some_and(|r| !is_unknown(r[x])) {
                        continue;
                    }
                    let (x0, wx) = xs.of(x);
                    let (mut a, mut b) = (0f32, 0f32);
                    for (i, &wi) in wx.iter().enumerate() {
                        a += wi * row_a[x0 + i];
                        b += wi * row_b[x0 + i];
                    }
                    let k = y * w + x;
                    out(k, a * guide(k) + b);
                }
            }
        }
    }
}

/// Whether the trimap leaves a pixel to the matting.
fn is_unknown(v: u8) -> bool {
    v != FOREGROUND && v != BACKGROUND
}

/// Whether any pixel of `t` is unknown, without stopping at the first (so it vectorises).
fn any_unknown(t: &[u8]) -> bool {
    t.iter().fold(false, |any, &v| any | is_unknown(v))
}

/// Interpolation taps in one allocation, the weights as f32 (as they are used): for each
/// output sample, the first input sample and its weights.
struct FlatTaps {
    first: Vec<usize>,
    /// `weights[bounds[x]..bounds[x + 1]]` are sample x's.
    bounds: Vec<usize>,
    weights: Vec<f32>,
}

impl FlatTaps {
    fn new(taps: &[(u32, Vec<f64>)]) -> Self {
        let mut bounds = Vec::with_capacity(taps.len() + 1);
        bounds.push(0);
        let mut weights = Vec::new();
        for (_, w) in taps {
            weights.extend(w.iter().map(|&v| v as f32));
            bounds.push(weights.len());
        }
        Self {
            first: taps.iter().map(|(f, _)| *f as usize).collect(),
            bounds,
            weights,
        }
    }

    fn of(&self, x: usize) -> (usize, &[f32]) {
        (
            self.first[x],
            &self.weights[self.bounds[x]..self.bounds[x + 1]],
        )
    }
}

/// The classic guided filter of `p` with guide `guide` (same size), window radius
/// `radius`, regularisation `epsilon`.
pub fn guided_filter(guide: &Plane, p: &Plane, radius: u32, epsilon: f32) -> Plane {
    let (mean_a, mean_b) = coefficients(&mut Scratch::default(), guide, p, radius, epsilon);
    LinearModel { mean_a, mean_b }.apply(guide)
}

/// The box means of the local linear coefficients `a` and `b` of `p ~ a I + b`, their
/// planes lent from `scratch`.
fn coefficients(
    scratch: &mut Scratch,
    guide: &Plane,
    p: &Plane,
    radius: u32,
    epsilon: f32,
) -> (Plane, Plane) {
    debug_assert_eq!((guide.width, guide.height), (p.width, p.height));
    let (w, h) = (guide.width as usize, guide.height as usize);
    let r = radius as usize;
    let mut boxf = BoxFilter::new(w, h, r, scratch);
    let i = &guide.data;
    let mut ip = boxf.scratch.plane(w * h);
    let mut ii = boxf.scratch.plane(w * h);
    for (((ip, ii), &a), &b) in ip.iter_mut().zip(ii.iter_mut()).zip(i).zip(&p.data) {
        *ip = a * b;
        *ii = a * a;
    }
    let [mean_i, mean_p, corr_ip, corr_ii] = boxf.means([i, &p.data, &ip, &ii]);
    let mut a = ip; // reuse the allocation
    let mut b = ii;
    for k in 0..w * h {
        let cov = corr_ip[k] - mean_i[k] * mean_p[k];
        let var = corr_ii[k] - mean_i[k] * mean_i[k];
        a[k] = cov / (var + epsilon);
        b[k] = mean_p[k] - a[k] * mean_i[k];
    }
    let [mean_a, mean_b] = boxf.means([&a, &b]);
    for plane in [mean_i, mean_p, corr_ip, corr_ii, a, b] {
        boxf.scratch.keep(plane);
    }
    (
        Plane::new(guide.width, guide.height, mean_a),
        Plane::new(guide.width, guide.height, mean_b),
    )
}

/// Mean over the (2r+1)^2 window clipped to the image (sum of in-bounds samples over
/// their count). Sums run in f64 so that the running add/subtract does not drift on a
/// 4000-pixel line.
struct BoxFilter<'a> {
    w: usize,
    h: usize,
    r: usize,
    /// Where its sums and its output planes are: each plane's horizontal window sums,
    /// then its running column sums.
    scratch: &'a mut Scratch,
    inv_count_x: Vec<f32>,
}

impl<'a> BoxFilter<'a> {
    fn new(w: usize, h: usize, r: usize, scratch: &'a mut Scratch) -> Self {
        let inv_count_x = (0..w).map(|x| 1.0 / window_len(x, r, w) as f32).collect();
        Self {
            w,
            h,
            r,
            scratch,
            inv_count_x,
        }
    }

    /// The means of `N` planes, each plane's additions the ones it gets alone, in the same
    /// order (so the same bits). The horizontal running sum is a chain of dependent f64
    /// adds; the planes' chains are independent, so stepping them together lets the CPU
    /// overlap them (the guided filter's four planes in the time of about two).
    fn means<const N: usize>(&mut self, src: [&[f32]; N]) -> [Vec<f32>; N] {
        let (w, h, r) = (self.w, self.h, self.r);
        let plane = w * h;
        let Scratch {
            spare,
            row_sums,
            column_acc,
            ..
        } = &mut *self.scratch;
        // Every sum is written before it is read.
        row_sums.resize(N * plane, 0.0);
        // Horizontal window sums, the planes' rows side by side.
        for y in 0..h {
            let rows: [&[f32]; N] = std::array::from_fn(|p| &src[p][y * w..(y + 1) * w]);
            let mut s: [f64; N] = std::array::from_fn(|p| {
                rows[p][..=r.min(w - 1)].iter().map(|&v| f64::from(v)).sum()
            });
            for x in 0..w {
                for p in 0..N {
                    row_sums[p * plane + y * w + x] = s[p] as f32;
                    if x + r + 1 < w {
                        s[p] += f64::from(rows[p][x + r + 1]);
                    }
                    if x >= r {
                        s[p] -= f64::from(rows[p][x - r]);
                    }
                }
            }
        }
        // Vertical window sums, a row at a time so memory is read in order.
        column_acc.resize(w, 0.0);
        std::array::from_fn(|p| {
            let row_sums = &row_sums[p * plane..(p + 1) * plane];
            let inv_count_x = &self.inv_count_x;
            let mut out = lend(spare, plane);
            column_acc.iter_mut().for_each(|a| *a = 0.0);
            for y in 0..=r.min(h - 1) {
                add_row(column_acc, &row_sums[y * w..(y + 1) * w], 1.0);
            }
            for y in 0..h {
                let inv_count_y = 1.0 / window_len(y, r, h) as f32;
                let dst = &mut out[y * w..(y + 1) * w];
                for ((d, a), icx) in dst.iter_mut().zip(column_acc.iter()).zip(inv_count_x) {
                    *d = *a as f32 * icx * inv_count_y;
                }
                if y + r + 1 < h {
                    add_row(column_acc, &row_sums[(y + r + 1) * w..(y + r + 2) * w], 1.0);
                }
                if y >= r {
                    add_row(column_acc, &row_sums[(y - r) * w..(y - r + 1) * w], -1.0);
                }
            }
            out
        })
    }
}

fn add_row(acc: &mut [f64], row: &[f32], sign: f64) {
    for (a, &v) in acc.iter_mut().zip(row) {
        *a += sign * f64::from(v);
    }
}

/// How many of the samples `i - r ..= i + r` fall inside `0..len`.
fn window_len(i: usize, r: usize, len: usize) -> usize {
    (i + r).min(len - 1) - i.saturating_sub(r) + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::RgbImage;

    fn brute_box(src: &[f32], w: usize, h: usize, r: usize) -> Vec<f32> {
        let mut out = vec![0f32; w * h];
        for y in 0..h {
            for x in 0..w {
                let (mut s, mut n) = (0f64, 0usize);
                for yy in y.saturating_sub(r)..=(y + r).min(h - 1) {
                    for xx in x.saturating_sub(r)..=(x + r).min(w - 1) {
                        s += f64::from(src[yy * w + xx]);
                        n += 1;
                    }
                }
                out[y * w + x] = (s / n as f64) as f32;
            }
        }
        out
    }

    #[test]
    fn box_mean_equals_brute_force_including_edges() {
        for (w, h, r) in [(13, 7, 2), (5, 9, 4), (1, 1, 3), (8, 3, 10)] {
            let src: Vec<f32> = (0..w * h).map(|k| ((k * 37) % 11) as f32 / 10.0).collect();
            let [fast] = BoxFilter::new(w, h, r, &mut Scratch::default()).means([&src]);
            let slow = brute_box(&src, w, h, r);
            for (a, b) in fast.iter().zip(&slow) {
                assert!((a - b).abs() < 1e-5, "w={w} h={h} r={r}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn planes_filtered_together_have_the_bits_of_each_alone() {
        let (w, h, r) = (37, 23, 4);
        let planes: Vec<Vec<f32>> = (0..4)
            .map(|p| {
                (0..w * h)
                    .map(|k| ((k * (7 + p) + p * 13) % 29) as f32 / 29.0 + 1e-3 * p as f32)
                    .collect()
            })
            .collect();
        let mut scratch = Scratch::default();
        let mut boxf = BoxFilter::new(w, h, r, &mut scratch);
        let together = boxf.means([&planes[0], &planes[1], &planes[2], &planes[3]]);
        for (plane, got) in planes.iter().zip(&together) {
            let [alone] = BoxFilter::new(w, h, r, &mut Scratch::default()).means([plane]);
            assert!(got
                .iter()
                .zip(&alone)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        // The scratch left by four planes does not leak into two.
        let [a, b] = boxf.means([&planes[3], &planes[0]]);
        assert_eq!((&a, &b), (&together[3], &together[0]));
    }

    #[test]
    fn constant_mask_passes_through() {
        let guide = Plane::new(6, 4, (0..24).map(|k| k as f32 / 24.0).collect());
        let p = Plane::filled(6, 4, 0.7);
        let q = guided_filter(&guide, &p, 2, 1e-3);
        assert!(
            q.data.iter().all(|v| (v - 0.7).abs() < 1e-4),
            "{:?}",
            q.data
        );
    }

    #[test]
    fn fast_filter_with_subsample_one_is_the_classic_filter() {
        let (w, h) = (20u32, 12u32);
        let image = gray_image(w, h, |k| ((k * 7) % 13) as f32 / 13.0);
        let guide = luma(image.as_raw(), w, h);
        let p = Plane::new(
            w,
            h,
            (0..w * h).map(|k| ((k * 5) % 11) as f32 / 11.0).collect(),
        );
        let classic = guided_filter(&guide, &p, 3, 1e-3);
        let fast = fit(Lanes::ONE, &mut Resizer::new(), &image, &p, 3, 1e-3, 1)
            .unwrap()
            .apply(&guide);
        for (a, b) in classic.data.iter().zip(&fast.data) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    /// A gray RGB8 image whose pixel `k` (row-major) has the level `level(k)` in [0, 1].
    fn gray_image(w: u32, h: u32, level: impl Fn(u32) -> f32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| {
            let v = (level(y * w + x) * 255.0).round() as u8;
            image::Rgb([v, v, v])
        })
    }

    #[test]
    fn fast_filter_keeps_a_sharp_edge_of_the_guide() {
        // Guide: sharp vertical edge at x = 40; coarse mask: a blurry version at 1/4 size.
        let (w, h) = (80u32, 32u32);
        let image = gray_image(w, h, |k| f32::from(k % w >= 40));
        let coarse = Plane::new(
            20,
            8,
            (0..160)
                .map(|k| ((k % 20) as f32 - 6.0).clamp(0.0, 8.0) / 8.0)
                .collect(),
        );
        let q = fit(Lanes::ONE, &mut Resizer::new(), &image, &coarse, 8, 1e-4, 4)
            .unwrap()
            .apply(&luma(image.as_raw(), w, h));
        let row = &q.data[(16 * w) as usize..(17 * w) as usize];
        assert!(row[30] < 0.2 && row[50] > 0.7, "{row:?}");
        assert!(
            row[40] - row[39] > 0.3,
            "the step sits on the guide's edge: {row:?}"
        );
    }

    #[test]
    fn alpha_evaluates_the_unknown_band_and_trusts_the_rest() {
        let (w, h) = (40u32, 10u32);
        let image = gray_image(w, h, |k| f32::from(k % w >= 20));
        let coarse = Plane::new(10, 3, (0..30).map(|k| f32::from(k % 10 >= 5)).collect());
        let model = fit(Lanes::ONE, &mut Resizer::new(), &image, &coarse, 4, 1e-4, 2).unwrap();
        let q = model.apply(&luma(image.as_raw(), w, h));
        let trimap = GrayImage::from_fn(w, h, |x, _| {
            image::Luma([match x {
                0..=14 => BACKGROUND,
                25.. => FOREGROUND,
                _ => 128,
            }])
        });
        let alpha = model.alpha(Lanes::ONE, &image, &trimap);
        for x in 0..w {
            let want = match x {
                0..=14 => 0,
                25.. => 255,
                _ => (q.data[(5 * w + x) as usize].clamp(0.0, 1.0) * 255.0).round() as u8,
            };
            assert_eq!(alpha.get_pixel(x, 5)[0], want, "x = {x}");
        }
    }

    #[test]
    fn lanes_give_the_same_fit_and_alpha() {
        // Tall enough that 4 lanes each get rows, with an unknown band in every lane.
        let (w, h) = (123u32, 211u32);
        let image = RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 2 + y) as u8, (x ^ y) as u8, (y * 3) as u8])
        });
        let coarse = Plane::new(
            31,
            53,
            (0..31 * 53)
                .map(|k| ((k % 31) as f32 / 30.0).powi(2))
                .collect(),
        );
        let trimap = GrayImage::from_fn(w, h, |x, y| {
            image::Luma([match (x + y) % 60 {
                0..=19 => BACKGROUND,
                40.. => FOREGROUND,
                _ => 128,
            }])
        });
        let want_model = fit(Lanes::ONE, &mut Resizer::new(), &image, &coarse, 8, 1e-3, 4).unwrap();
        let want = want_model.alpha(Lanes::ONE, &image, &trimap);
        for lanes in 2..=4 {
            let lanes = Lanes::new(lanes).at_any_size();
            let model = fit(lanes, &mut Resizer::new(), &image, &coarse, 8, 1e-3, 4).unwrap();
            assert_eq!(model.mean_a, want_model.mean_a);
            assert_eq!(model.mean_b, want_model.mean_b);
            assert_eq!(model.alpha(lanes, &image, &trimap), want, "{lanes:?}");
        }
    }

    #[test]
    fn a_kept_scratch_fits_each_image_as_fresh_buffers_do() {
        // Sizes up and down, so that kept buffers are longer or shorter than the next
        // image needs; each image's own content, so that nothing of the last one may stay.
        let mut scratch = Scratch::default();
        for (k, (w, h)) in [(123u32, 211u32), (40, 30), (200, 150), (123, 211)]
            .into_iter()
            .enumerate()
        {
            let k = k as u32;
            let image = RgbImage::from_fn(w, h, |x, y| {
                image::Rgb([
                    (x * (k + 2) + y) as u8,
                    (x ^ (y + k)) as u8,
                    (y * 3 + k) as u8,
                ])
            });
            let coarse = Plane::new(
                17,
                13,
                (0..17 * 13)
                    .map(|i| ((i * (k + 1)) % 17) as f32 / 16.0)
                    .collect(),
            );
            let trimap = GrayImage::from_fn(w, h, |x, y| {
                image::Luma([match (x + 2 * y + k) % 50 {
                    0..=14 => BACKGROUND,
                    35.. => FOREGROUND,
                    _ => 128,
                }])
            });
            let fresh = fit(Lanes::ONE, &mut Resizer::new(), &image, &coarse, 8, 1e-3, 4).unwrap();
            let kept = fit_in(
                Lanes::ONE,
                &mut Resizer::new(),
                &mut scratch,
                &image,
                &coarse,
                8,
                1e-3,
                4,
            )
            .unwrap();
            assert_eq!(kept.mean_a, fresh.mean_a, "{w}x{h}");
            assert_eq!(kept.mean_b, fresh.mean_b, "{w}x{h}");
            // Into a plane holding another image's bytes: every byte is written.
            let mut alpha = vec![77u8; (w * h) as usize];
            kept.alpha_into(Lanes::ONE, &image, trimap.as_raw(), &mut alpha);
            assert_eq!(
                alpha,
                fresh.alpha(Lanes::ONE, &image, &trimap).into_raw(),
                "{w}x{h}"
            );
            scratch.keep_model(kept);
        }
        assert!(!scratch.spare.is_empty() && scratch.spare.len() <= SPARE_PLANES);
    }

    #[test]
    fn an_idle_server_gives_back_the_kept_scratch_but_not_one_in_use() {
        let (w, h) = (64u32, 48u32);
        let image = RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 3) as u8, y as u8, 9]));
        let coarse = Plane::filled(8, 6, 0.5);
        let (kept, busy) = (KeptScratch::default(), KeptScratch::default());
        for scratch in [&kept, &busy] {
            let mut s = scratch.lock();
            let model = fit_in(
                Lanes::ONE,
                &mut Resizer::new(),
                &mut s,
                &image,
                &coarse,
                4,
                1e-3,
                1,
            )
            .unwrap();
            s.keep_model(model);
            assert!(s.bytes() >= 10 * 4 * (w * h) as usize, "{}", s.bytes());
        }
        let in_use = busy.lock();
        release_kept_scratch();
        assert_eq!(kept.lock().bytes(), 0);
        assert!(in_use.bytes() > 0);
    }

    #[test]
    fn edge_follows_the_guide() {
        // The guide has a sharp edge at x = 8; the coarse mask a soft ramp around it.
        let (w, h) = (16usize, 4usize);
        let guide = Plane::new(
            w as u32,
            h as u32,
            (0..w * h)
                .map(|k| if k % w >= 8 { 1.0 } else { 0.0 })
                .collect(),
        );
        let p = Plane::new(
            w as u32,
            h as u32,
            (0..w * h)
                .map(|k| ((k % w) as f32 - 4.0).clamp(0.0, 8.0) / 8.0)
                .collect(),
        );
        let q = guided_filter(&guide, &p, 3, 1e-4);
        let row: Vec<f32> = q.data[w..2 * w].to_vec();
        // Sharper than the input across the edge: the step from x=7 to x=8 grows.
        assert!(row[8] - row[7] > p.data[8] - p.data[7] + 0.2, "{row:?}");
    }
}
