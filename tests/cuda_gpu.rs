//! Every CUDA kernel against its CPU stage, and `GpuStages` against `Pipeline`, on a
//! GPU: the real one where there is a CUDA driver, celer's stand-in driver otherwise
//! (tests/gpu_support). Nothing here skips: a test that gets no GPU fails.
//!
//! Tolerances: preprocess (f32 and f16), trimap, erosion, NEAREST, luma, the guided
//! filter's alpha step and composite are exact (integer and IEEE f32 in the CPU's
//! order). No kernel computes in FP64 (tests/cuda_nvrtc.rs), so where the CPU does the
//! kernels are held to it by a bound each test states and derives, with what was
//! measured: the plane resize in f32 (a few 2^-24); the guided filter's box sums in fixed
//! point and float-float (the CPU's bits but for residues below 2^-40); the whole fast
//! guided filter and the pipelines within 1 LSB of alpha, on a bounded share of pixels.
//! The pipelines agree exactly on the trimap.

mod gpu_support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use celer::cuda::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use celer::cuda::guided::{FastGuidedFilter, GuidedParams};
use celer::cuda::launch::{taps_capacity, GpuNearest, GpuTaps, Launcher, ModelInput};
use celer::matte::{Planes, StageTimings};
use celer::replica::cpu::CpuStages;
use celer::replica::gpu::{GpuLimits, GpuStages, ModelSource};
use celer::spec::MattingSpec;
use celer::spec::{Normalize, PipelineSpec, Scale};
use celer::stages::lanes::Lanes;
use celer::stages::plane::Plane;
use celer::stages::{composite, guided_filter, preprocess, resample, trimap};
use fast_image_resize::Resizer;
use image::{GrayImage, Rgb, RgbImage};

fn up<T: DeviceRepr>(s: &Arc<CudaStream>, data: &[T]) -> CudaSlice<T> {
    s.clone_htod(data).unwrap()
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    s.alloc_zeros(n.max(1)).unwrap()
}

fn down<T: DeviceRepr>(s: &Arc<CudaStream>, buf: &CudaSlice<T>, n: usize) -> Vec<T> {
    let v = s.clone_dtoh(buf).unwrap();
    s.synchronize().unwrap();
    v[..n].to_vec()
}

/// A deterministic, textured test image (no two neighbours alike, full value range).
fn texture(w: u32, h: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = (x.wrapping_mul(73_856_093) ^ y.wrapping_mul(19_349_663) ^ seed)
            .wrapping_mul(2_654_435_761);
        Rgb([
            (v >> 24) as u8,
            (v >> 16) as u8,
            ((x * 255) / w.max(1)) as u8,
        ])
    })
}

fn unit_pattern(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|k| ((k.wrapping_mul(2_654_435_761) ^ seed) >> 8) as f32 / (1u32 << 24) as f32)
        .collect()
}

/// Sizes that catch indexing mistakes: 1x1, odd, not multiples of 4, the largest photo.
const AWKWARD: [(u32, u32); 6] = [
    (1, 1),
    (7, 5),
    (333, 517),
    (1001, 3),
    (1918, 1077),
    (4032, 3024),
];

fn norms() -> [Normalize; 2] {
    [
        Normalize {
            scale: Scale::ImageMax,
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
        },
        Normalize {
            scale: Scale::Fixed(1.0 / 255.0),
            mean: [0.5, 0.5, 0.5],
            std: [0.5, 0.5, 0.5],
        },
    ]
}

#[test]
fn preprocess_is_bit_exact_in_f32_and_f16() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    for (sw, sh) in AWKWARD {
        for (dw, dh) in [(320, 320), (1024, 512), (sw, sh)] {
            let image = texture(sw, sh, sw ^ dh);
            let (oh, wh) = taps_capacity(sw.max(sh), dw);
            let (ov, wv) = taps_capacity(sw.max(sh), dh);
            let mut ht = GpuTaps::<i32>::alloc(&s, oh, wh).unwrap();
            let mut vt = GpuTaps::<i32>::alloc(&s, ov, wv).unwrap();
            ht.set_fixed(&s, sw, dw).unwrap();
            vt.set_fixed(&s, sh, dh).unwrap();
            let src = up(&s, image.as_raw());
            let px = (dw * dh) as usize;
            for norm in norms() {
                let mut resized_cpu = Vec::new();
                preprocess::resize_rgb(&image, dw, dh, &mut resized_cpu);
                let mut want = vec![0f32; px * 3];
                preprocess::normalize_into(&resized_cpu, &norm, &mut want);

                let mut tmp = zeros::<u8>(&s, dw as usize * sh as usize * 3);
                let mut resized = zeros::<u8>(&s, px * 3);
                let mut max = zeros::<u32>(&s, 1);
                let mut out32 = zeros::<f32>(&s, px * 3);
                l.preprocess(
                    &src,
                    (sw, sh),
                    &ht,
                    &vt,
                    (dw, dh),
                    &norm,
                    &mut tmp,
                    &mut resized,
                    &mut max,
                    ModelInput::F32(&mut out32),
                )
                .unwrap();
                let got = down(&s, &out32, px * 3);
                let diff = got
                    .iter()
                    .zip(&want)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    diff, 0,
                    "{sw}x{sh} -> {dw}x{dh} {:?}: {diff} values differ",
                    norm.scale
                );

                let mut out16 = zeros::<half::f16>(&s, px * 3);
                l.preprocess(
                    &src,
                    (sw, sh),
                    &ht,
                    &vt,
                    (dw, dh),
                    &norm,
                    &mut tmp,
                    &mut resized,
                    &mut max,
                    ModelInput::F16(&mut out16),
                )
                .unwrap();
                let got16 = down(&s, &out16, px * 3);
                let diff16 = got16
                    .iter()
                    .zip(&want)
                    .filter(|(a, b)| a.to_bits() != half::f16::from_f32(**b).to_bits())
                    .count();
                assert_eq!(diff16, 0, "f16 {sw}x{sh} -> {dw}x{dh} {:?}", norm.scale);
            }
        }
    }
}

#[test]
fn probability_and_class_trimaps_are_exact() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    for (w, h) in [(1, 1), (7, 5), (320, 320), (333, 17)] {
        let n = (w * h) as usize;
        // Values beyond [0, 1] and exact threshold hits.
        let mut raw: Vec<f32> = unit_pattern(n, w).iter().map(|v| v * 1.4 - 0.2).collect();
        if n > 3 {
            raw[1] = 0.94;
            raw[2] = 0.04;
            raw[3] = f32::NAN;
        }
        let out = celer::tensor::Tensor {
            shape: vec![1, 1, h as usize, w as usize],
            data: raw.clone(),
        };
        for minmax in [false, true] {
            let mask = trimap::probability_mask(&out, minmax).unwrap();
            let want_t = trimap::threshold(&mask, 0.94, 0.04);
            let dmask = up(&s, &raw);
            let (mut lohi, mut coarse, mut tri) =
                (zeros::<u32>(&s, 2), zeros::<f32>(&s, n), zeros::<u8>(&s, n));
            l.probability_trimap(
                &dmask,
                (w, h),
                minmax,
                0.94,
                0.04,
                &mut lohi,
                &mut coarse,
                &mut tri,
            )
            .unwrap();
            let got_c = down(&s, &coarse, n);
            let got_t = down(&s, &tri, n);
            assert_eq!(&got_t, want_t.as_raw(), "trimap {w}x{h} minmax={minmax}");
            for (a, b) in got_c.iter().zip(&mask.data) {
                assert!(
                    a == b || (a.is_nan() && b.is_nan()),
                    "coarse {w}x{h}: {a} vs {b}"
                );
            }
        }
        // Three classes, ties included.
        let scores: Vec<f32> = unit_pattern(3 * n, h)
            .iter()
            .map(|v| (v * 4.0).floor())
            .collect();
        let out = celer::tensor::Tensor {
            shape: vec![1, 3, h as usize, w as usize],
            data: scores.clone(),
        };
        let (want_t, want_c) = trimap::classes(&out, &[0, 128, 255]).unwrap();
        let (ds, dv) = (up(&s, &scores), up(&s, &[0u8, 128, 255]));
        let (mut coarse, mut tri) = (zeros::<f32>(&s, n), zeros::<u8>(&s, n));
        l.classes_trimap(&ds, (w, h), 3, &dv, &mut coarse, &mut tri)
            .unwrap();
        assert_eq!(&down(&s, &tri, n), want_t.as_raw(), "classes {w}x{h}");
        assert_eq!(down(&s, &coarse, n), want_c.data, "classes coarse {w}x{h}");
    }
}

#[test]
fn erosion_and_nearest_resize_are_exact() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    for (w, h) in [(1, 1), (7, 3), (320, 320), (97, 31)] {
        let n = (w * h) as usize;
        // Blobs of each value, so that windows are sometimes uniform.
        let t = GrayImage::from_fn(w, h, |x, y| {
            image::Luma([[0u8, 128, 255][((x / 5 + y / 4) % 3) as usize]])
        });
        for radius in [0, 1, 2, 5, 40] {
            let mut want = t.clone();
            trimap::erode(&mut want, radius);
            let mut dt = up(&s, t.as_raw());
            let mut flags = zeros::<u8>(&s, n);
            l.erode(&mut dt, (w, h), radius, &mut flags).unwrap();
            assert_eq!(&down(&s, &dt, n), want.as_raw(), "erode {w}x{h} r={radius}");
        }
        for (dw, dh) in [(1, 1), (5, 7), (4032, 3024), (w * 3 + 1, h)] {
            let want = resample::resize_nearest(&t, dw, dh);
            let mut idx = GpuNearest::alloc(&s, dw, dh).unwrap();
            idx.set(&s, (w, h), (dw, dh)).unwrap();
            let mut dst = zeros::<u8>(&s, (dw * dh) as usize);
            l.resize_nearest(&up(&s, t.as_raw()), &idx, &mut dst)
                .unwrap();
            assert_eq!(
                &down(&s, &dst, (dw * dh) as usize),
                want.as_raw(),
                "nearest {w}x{h} -> {dw}x{dh}"
            );
        }
    }
}

/// How an f32 plane from the GPU differs from the CPU's: values not bit-identical, those
/// further than [`PlaneDiff::NEAR`], and the largest and the mean |GPU - CPU|.
#[derive(Debug, Default, Clone, Copy)]
struct PlaneDiff {
    values: usize,
    differ: usize,
    far: usize,
    max: f32,
    sum: f64,
}

impl PlaneDiff {
    fn of(got: &[f32], want: &[f32]) -> Self {
        let mut d = PlaneDiff {
            values: want.len(),
            ..Self::default()
        };
        for (a, b) in got.iter().zip(want) {
            if a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()) {
                d.differ += 1;
                let e = (a - b).abs();
                d.max = d.max.max(e);
                d.sum += f64::from(e);
                let ulp = f32::from_bits(b.abs().to_bits() + 1) - b.abs();
                // A NaN on one side only is far too.
                if e.is_nan() || e > ulp.max(Self::NEAR) {
                    d.far += 1;
                }
            }
        }
        d
    }

    /// What two running sums of the same values may leave where their exact sum is about
    /// 0: 2^-40, about n x 2^-48 x their largest value (guided_filter.cu, WideSum).
    const NEAR: f32 = 1.0 / (1u64 << 40) as f32;

    fn mean(&self) -> f64 {
        self.sum / self.values.max(1) as f64
    }
}

impl std::fmt::Display for PlaneDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} differ ({} by more than 1 ulp and 2^-40), max {:.2e}, mean {:.2e}",
            self.differ,
            self.values,
            self.far,
            self.max,
            self.mean()
        )
    }
}

/// How an 8-bit plane from the GPU differs from the CPU's: values that differ, the most.
#[derive(Debug, Default, Clone, Copy)]
struct ByteDiff {
    values: usize,
    differ: usize,
    max: u8,
}

impl ByteDiff {
    fn of(got: &[u8], want: &[u8]) -> Self {
        assert_eq!(got.len(), want.len());
        let differ = got.iter().zip(want).filter(|(a, b)| a != b).count();
        ByteDiff {
            values: want.len(),
            differ,
            max: max_difference(got, want),
        }
    }

    /// The share of values that differ, in percent.
    fn percent(&self) -> f64 {
        100.0 * self.differ as f64 / self.values.max(1) as f64
    }
}

impl std::fmt::Display for ByteDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} differ ({:.4}%), max {} LSB",
            self.differ,
            self.values,
            self.percent(),
            self.max
        )
    }
}

/// The test photos (tests/data/fetched, `make models`), as RGB8. Missing ones fail.
fn photos() -> Vec<(String, RgbImage)> {
    let fetched = repo("tests/data/fetched");
    [
        "astronaut.png",
        "chelsea.png",
        "chelsea-exif6.jpg",
        "photo-1920x1080.jpg",
        "photo-4032x3024.jpg",
    ]
    .iter()
    .map(|name| {
        let path = fetched.join(name);
        let image = image::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run `make models`)", path.display()));
        (name.to_string(), image.into_rgb8())
    })
    .collect()
}

/// A plane that is 0 left of column w/2 and above row h/2 or right and below, 1
/// elsewhere: hard edges across both axes, large flat areas.
fn edge_plane(w: u32, h: u32) -> Vec<f32> {
    (0..w * h)
        .map(|k| f32::from(u8::from((k % w < w / 2) != (k / w < h / 2))))
        .collect()
}

/// The GPU's plane resize of `src` (`w` x `h`) to `dw` x `dh`.
fn gpu_resize_plane(
    l: &Launcher<'_>,
    src: &[f32],
    (w, h): (u32, u32),
    (dw, dh): (u32, u32),
) -> Vec<f32> {
    let s = l.stream;
    let (oh, wh) = taps_capacity(w, dw);
    let (ov, wv) = taps_capacity(h, dh);
    let mut ht = GpuTaps::<f32>::alloc(s, oh, wh).unwrap();
    let mut vt = GpuTaps::<f32>::alloc(s, ov, wv).unwrap();
    ht.set_convolution(s, w, dw).unwrap();
    vt.set_convolution(s, h, dh).unwrap();
    let mut tmp = zeros::<f32>(s, (dw * h) as usize);
    let mut dst = zeros::<f32>(s, (dw * dh) as usize);
    l.resize_plane(&up(s, src), (w, h), &ht, &vt, &mut tmp, &mut dst)
        .unwrap();
    down(s, &dst, (dw * dh) as usize)
}

/// The plane resize (the mask to the guided filter's size, a matting model's alpha to
/// the source's) computes in f32 where the CPU's fast_image_resize computes in f64.
///
/// The bound: `mirror::resize_bound` (src/cuda/taps.rs), from the roundings of the f32
/// sums: (n_h + n_v + 4) x 2^-24 x max|s| for passes of n_h and n_v taps; 10 x 2^-24 =
/// 6e-7 upscaling a plane in [0, 1]. An alpha quantised to 8 bits then moves by at most
/// 1 LSB, and only where 255 x alpha lies within 255 x that of a rounding boundary: a
/// share of at most 2 x 255 x the bound of spread values (0.03% upscaling; asserted).
///
/// Measured on the stand-in (x86-64, the kernels as host C++ with -ffp-contract=off, as
/// NVRTC's --fmad=false runs them), the largest |GPU - CPU| in units of 2^-24:
/// - textures 320x320 to 4032x3024, 1x1, 333x517; 7x5 to 3x2; 1x1 to 1918x1077; 320 to
///   320: 3 (mean 0.33 over all values; 8-bit: 71 of 12192768 pixels moved, 1 LSB),
///   3, 2, 1, 0, 0;
/// - hard 0/1 edges up to 4032x3024 and down to 320x320: 1 and 2, no 8-bit change; the
///   4032 taps of 4032x7 to 1x7: 4; a flat 0.7 up to 4032x3024: 2, which moves 9% of
///   the 8-bit values by 1 (0.7 x 255 rounds at 178.49999);
/// - each photo's luma (astronaut.png, chelsea.png, chelsea-exif6.jpg,
///   photo-1920x1080.jpg, photo-4032x3024.jpg) down to 320x320: 3, 2, 2, 3, 4; the same
///   at 320x320 up to the photo's size (the alpha path): 2, 2, 2, 3, 3, quantised to 8
///   bits 0, 1, 0, 3 and 56 pixels moved by 1 LSB (at most 0.0007%).
///
/// And the kernels compute exactly `mirror::resize_plane`: the same f32 operations in
/// the same order, bit for bit.
#[test]
fn plane_resize_is_held_to_the_cpu() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    let mut failed = Vec::new();
    let mut check = |name: &str, src: &[f32], w: u32, h: u32, dw: u32, dh: u32| {
        let got = gpu_resize_plane(&l, src, (w, h), (dw, dh));
        let mirror = celer::cuda::taps::mirror::resize_plane(src, w, h, dw, dh);
        assert!(
            got.iter()
                .zip(&mirror)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name} {w}x{h} -> {dw}x{dh}: the kernels are not their mirror's f32 sums"
        );
        let plane = Plane::new(w, h, src.to_vec());
        let want = resample::resize_plane(&mut Resizer::new(), &plane, dw, dh).unwrap();
        let diff = PlaneDiff::of(&got, &want.data);
        let max_abs = src.iter().fold(0f32, |m, v| m.max(v.abs()));
        let bound = celer::cuda::taps::mirror::resize_bound(w, h, dw, dh, max_abs);
        let quantised = ByteDiff::of(
            composite::quantize_alpha(&Plane::new(dw, dh, got.clone())).as_raw(),
            composite::quantize_alpha(&want).as_raw(),
        );
        let line = format!(
            "{name} {w}x{h} -> {dw}x{dh}: {diff} ({:.1} x 2^-24, bound {:.1}); 8-bit: {quantised}",
            diff.max / f32::EPSILON * 2.0,
            bound / f32::EPSILON * 2.0,
        );
        let _ = writeln!(std::io::stderr(), "plane resize {line}");
        // Spread values move across an 8-bit rounding boundary with a probability of at
        // most 2 x 255 x the bound. A flat plane sits wherever its value is: on a
        // boundary every pixel may move (0.7 x 255 = 178.49999: 9% do), so its share is
        // not bounded, only the step.
        let share_bound = 2.0 * 255.0 * f64::from(bound) * 100.0;
        let spread = name != "flat";
        if diff.max > bound || quantised.max > 1 || (spread && quantised.percent() > share_bound) {
            failed.push(line);
        }
    };
    for ((w, h), (dw, dh)) in [
        ((320, 320), (4032, 3024)),
        ((320, 320), (1, 1)),
        ((320, 320), (333, 517)),
        ((7, 5), (3, 2)),
        ((1, 1), (1918, 1077)),
        ((320, 320), (320, 320)),
    ] {
        check("texture", &unit_pattern((w * h) as usize, dw), w, h, dw, dh);
    }
    check("edges", &edge_plane(320, 320), 320, 320, 4032, 3024);
    check("flat", &vec![0.7; 320 * 320], 320, 320, 4032, 3024);
    check("edges", &edge_plane(4032, 3024), 4032, 3024, 320, 320);
    check("4032 taps", &unit_pattern(4032 * 7, 3), 4032, 7, 1, 7);
    for (name, photo) in photos() {
        let (w, h) = photo.dimensions();
        let luma = guided_filter::luma(photo.as_raw(), w, h);
        check(&name, &luma.data, w, h, 320, 320);
        let small = resample::resize_plane(&mut Resizer::new(), &luma, 320, 320).unwrap();
        check(&name, &small.data, 320, 320, w, h);
    }
    assert!(
        failed.is_empty(),
        "beyond the bound:\n{}",
        failed.join("\n")
    );
}

/// A trimap with all three values in runs, so every branch of the alpha step is taken.
fn banded_trimap(w: u32, h: u32) -> GrayImage {
    GrayImage::from_fn(w, h, |x, y| {
        image::Luma([[0u8, 128, 255, 128][((x / 3 + y / 2) % 4) as usize]])
    })
}

#[test]
fn guided_alpha_applies_the_cpu_model_exactly() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    for (w, h) in AWKWARD {
        let n = (w * h) as usize;
        let image = texture(w, h, 5);
        let mask = Plane::new(97, 61, unit_pattern(97 * 61, w));
        let trimap = banded_trimap(w, h);
        let rgb = up(&s, image.as_raw());
        for subsample in [1, 2, 4] {
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
            let (lw, lh) = (model.mean_a.width, model.mean_a.height);
            let (ox, wx) = taps_capacity(lw, w);
            let (oy, wy) = taps_capacity(lh, h);
            let mut xs = GpuTaps::<f32>::alloc(&s, ox, wx).unwrap();
            let mut ys = GpuTaps::<f32>::alloc(&s, oy, wy).unwrap();
            xs.set_upsample(&s, lw, w).unwrap();
            ys.set_upsample(&s, lh, h).unwrap();
            let (mut alpha, mut rgba) = (zeros::<u8>(&s, n), zeros::<u8>(&s, 4 * n));
            l.guided_alpha(
                &up(&s, &model.mean_a.data),
                &up(&s, &model.mean_b.data),
                (lw, lh),
                &xs,
                &ys,
                &rgb,
                &up(&s, trimap.as_raw()),
                (w, h),
                &mut alpha,
                Some(&mut rgba),
            )
            .unwrap();
            let got = down(&s, &alpha, n);
            assert_eq!(&got, want.as_raw(), "alpha {w}x{h} subsample {subsample}");
            let want_rgba = composite::cutout(&image, &want);
            assert_eq!(&down(&s, &rgba, 4 * n), want_rgba.as_raw(), "rgba {w}x{h}");
            let mut alpha_only = zeros::<u8>(&s, n);
            l.guided_alpha(
                &up(&s, &model.mean_a.data),
                &up(&s, &model.mean_b.data),
                (lw, lh),
                &xs,
                &ys,
                &rgb,
                &up(&s, trimap.as_raw()),
                (w, h),
                &mut alpha_only,
                None,
            )
            .unwrap();
            assert_eq!(down(&s, &alpha_only, n), got, "alpha-only {w}x{h}");
        }
    }
}

/// A disc of 1 on 0 (radius a third of the shorter side) with a linear edge `ramp`
/// pixels wide (0: a hard edge): a segmentation mask's shape, large flat areas.
fn disc_mask(w: u32, h: u32, ramp: f32) -> Plane {
    let (cx, cy) = (w as f32 / 2.0, h as f32 / 2.0);
    let radius = w.min(h) as f32 / 3.0;
    let data = (0..w * h)
        .map(|k| {
            let (dx, dy) = ((k % w) as f32 + 0.5 - cx, (k / w) as f32 + 0.5 - cy);
            let inside = radius - (dx * dx + dy * dy).sqrt();
            if ramp > 0.0 {
                (inside / ramp + 0.5).clamp(0.0, 1.0)
            } else {
                f32::from(u8::from(inside >= 0.0))
            }
        })
        .collect();
    Plane::new(w, h, data)
}

/// One allocation per filter setting, as `GpuStages` makes for its limits: sources up to
/// 4032x3024, masks up to `mask_max`.
fn guided_filter_for(
    s: &Arc<CudaStream>,
    (radius, epsilon, subsample): (u32, f32, u32),
    mask_max: (u32, u32),
) -> FastGuidedFilter {
    let params = GuidedParams {
        radius,
        epsilon,
        subsample,
    };
    FastGuidedFilter::alloc(s, params, 4032 * 3024, 4032, mask_max).expect("guided filter")
}

/// How the GPU's fit of `mask` to `image` (mean_a, mean_b) and its alpha under a banded
/// trimap differ from the CPU stage's; the cut-out is checked to be the alpha's.
fn guided_differences(
    l: &Launcher<'_>,
    filter: &mut FastGuidedFilter,
    (radius, epsilon, subsample): (u32, f32, u32),
    image: &RgbImage,
    mask: &Plane,
) -> (PlaneDiff, PlaneDiff, ByteDiff) {
    let s = l.stream;
    let (w, h) = image.dimensions();
    let n = (w * h) as usize;
    let trimap = banded_trimap(w, h);
    let model = guided_filter::fit(
        Lanes::ONE,
        &mut Resizer::new(),
        image,
        mask,
        radius,
        epsilon,
        subsample,
    )
    .unwrap();
    let want = model.alpha(Lanes::ONE, image, &trimap);
    let rgb = up(s, image.as_raw());
    filter
        .fit(
            l,
            &rgb,
            (w, h),
            &up(s, &mask.data),
            (mask.width, mask.height),
        )
        .unwrap();
    let fitted = filter.model().expect("fitted");
    let (lw, lh) = fitted.size;
    assert_eq!((lw, lh), (model.mean_a.width, model.mean_a.height));
    let low = (lw * lh) as usize;
    let mean_a = PlaneDiff::of(&down(s, fitted.mean_a, low), &model.mean_a.data);
    let mean_b = PlaneDiff::of(&down(s, fitted.mean_b, low), &model.mean_b.data);
    let (mut alpha, mut rgba) = (zeros::<u8>(s, n), zeros::<u8>(s, 4 * n));
    let tri = up(s, trimap.as_raw());
    filter
        .alpha(l, &rgb, (w, h), &tri, &mut alpha, Some(&mut rgba))
        .unwrap();
    let got = down(s, &alpha, n);
    let alpha_diff = ByteDiff::of(&got, want.as_raw());
    let got_image = GrayImage::from_raw(w, h, got).unwrap();
    assert_eq!(
        &down(s, &rgba, 4 * n),
        composite::cutout(image, &got_image).as_raw(),
        "rgba {w}x{h}"
    );
    (mean_a, mean_b, alpha_diff)
}

/// The guided filter's box sums without FP64 (guided_filter.cu): pass 1 in fixed point,
/// pass 2 in float-float. Fed the CPU's own inputs (a mask at the fit's size, which the
/// plane resize copies exactly), so that only the sums differ.
///
/// The bound, by construction: pass 1's sums of I (and of I*I for r <= 127) are the
/// CPU's exactly; those of p and I*p are within 2^-K (K >= 43) of the exact sums, and the
/// CPU's f64 ones within about 2^-40 of their largest, so their f32 means are the CPU's
/// but where the exact mean lies that close to a midpoint between two f32 values (about
/// 1 in 10^5), by 1 ulp then, and a and b by up to 1 ulp / (var + eps). Pass 2's
/// float-float and the CPU's f64 running sums round to the same f32 but within 2^-34 of
/// a midpoint, and leave residues below 2^-40 where their exact sum is about 0 (a = 0
/// under a flat mask). Asserted: mean_a and mean_b further than 1 ulp and 2^-40 from the
/// CPU's on at most 0.01% of values; alpha at most 1 LSB, on at most 0.01% of pixels.
///
/// Measured on the stand-in (x86-64, the kernels as host C++ with -ffp-contract=off, as
/// NVRTC's --fmad=false runs them): textures at every size, subsample 1, 2, 4, radius 1,
/// 8, 30 and 256, and a flat 12 MP image: mean_a, mean_b and alpha the CPU's bit for bit.
/// The photos under a soft-edged disc mask: mean_b and alpha bit for bit; mean_a too at
/// subsample 4, and at subsample 1 all but 0.06% to 0.4% of values (photo-4032x3024.jpg:
/// 18594 of 12192768; astronaut.png: 504 of 262144), which differ by at most 1.2e-14,
/// none by more than 1 ulp and 2^-40: residues of sums of a whose exact value is about 0.
#[test]
fn guided_fit_box_sums_are_held_to_the_cpu() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    let mut failed = Vec::new();
    let mut check = |name: &str,
                     image: &RgbImage,
                     mask: &dyn Fn(u32, u32) -> Plane,
                     settings: &[(u32, f32, u32)]| {
        for &setting in settings {
            let (radius, epsilon, subsample) = setting;
            let (w, h) = image.dimensions();
            let low = (w.div_ceil(subsample), h.div_ceil(subsample));
            let mut filter = guided_filter_for(&s, setting, low);
            let mask = mask(low.0, low.1);
            let (a, b, alpha) = guided_differences(&l, &mut filter, setting, image, &mask);
            let line = format!(
                "{name} {w}x{h} r={radius} eps={epsilon} s={subsample}: mean_a {a}; mean_b {b}; alpha {alpha}"
            );
            let _ = writeln!(std::io::stderr(), "box sums {line}");
            if a.far * 10_000 > a.values
                || b.far * 10_000 > b.values
                || alpha.max > 1
                || alpha.percent() > 0.01
            {
                failed.push(line);
            }
        }
    };
    let noise = |w: u32, h: u32| {
        // Values beyond [0, 1] too: the fit clamps them.
        let data = unit_pattern((w * h) as usize, 3)
            .iter()
            .map(|v| v * 1.4 - 0.2)
            .collect();
        Plane::new(w, h, data)
    };
    for (w, h) in AWKWARD {
        let settings: Vec<(u32, f32, u32)> = [1, 2, 4]
            .into_iter()
            .flat_map(|s| [(8, 1e-3, s), (1, 1e-4, s), (30, 1e-2, s)])
            .collect();
        check("texture", &texture(w, h, 7), &noise, &settings);
    }
    // The largest radius: the fewest fraction bits (43).
    for (w, h) in [(333, 517), (1918, 1077)] {
        check("texture", &texture(w, h, 9), &noise, &[(256, 1e-3, 1)]);
    }
    // A flat 12 MP image: var is 0 everywhere, a = cov / eps, where a sum that drifted
    // would show at once.
    let flat = RgbImage::from_pixel(4032, 3024, Rgb([128, 128, 128]));
    check(
        "flat",
        &flat,
        &|w, h| disc_mask(w, h, 0.0),
        &[(8, 1e-3, 4), (1, 1e-4, 1)],
    );
    for (name, photo) in photos() {
        check(
            &name,
            &photo,
            &|w, h| disc_mask(w, h, 4.0),
            &[(8, 1e-3, 4), (8, 1e-3, 1), (1, 1e-4, 1)],
        );
    }
    assert!(
        failed.is_empty(),
        "beyond the bound:\n{}",
        failed.join("\n")
    );
}

/// The whole fast guided filter against the CPU stage: a 320x320 mask (the model's)
/// resized to the fit's size in f32 (`plane_resize_is_held_to_the_cpu`), then the box
/// sums (`guided_fit_box_sums_are_held_to_the_cpu`), then the model applied at full size
/// (exact: `guided_alpha_applies_the_cpu_model_exactly`).
///
/// The bound: the resized mask p is within dp = `mirror::resize_bound` of the CPU's. That
/// moves mean_p and corr_Ip by at most dp, cov by at most sqrt(var) dp, a by at most
/// sqrt(var) dp / (var + eps) <= dp / (2 sqrt(eps)), and q = A I + B by at most
/// dq = (1 + 1 / (2 sqrt(eps))) dp (16.8 dp at eps = 1e-3, 51 dp at 1e-4): with dp a few
/// 2^-24, far below an 8-bit step, so the alpha moves by at most 1 LSB, on a share of at
/// most 2 x 255 x dq of pixels (about 0.5% at eps = 1e-3, 1.5% at 1e-4; asserted).
/// mean_a and mean_b are not the CPU's bits on most values (reported, not asserted).
///
/// Measured on the stand-in: alpha within 1 LSB everywhere; the most pixels moved were
/// 0.014% at r = 1, eps = 1e-4, subsample 4 (333x517: 24 of 172161; 4032x3024: 1444 of
/// 12192768), 0.003% at the served settings (r = 8, eps = 1e-3, subsample 4), and 1 pixel
/// of the 3003 of 1001x3; mean_a moved by at most 1.7e-4 (at eps = 1e-4).
#[test]
fn fast_guided_filter_matches_the_cpu_stage() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    let (mw, mh) = (320u32, 320u32);
    // Values beyond [0, 1] too: the fit clamps them.
    let mask = Plane::new(
        mw,
        mh,
        unit_pattern((mw * mh) as usize, 3)
            .iter()
            .map(|v| v * 1.4 - 0.2)
            .collect(),
    );
    let mut failed = Vec::new();
    for subsample in [1, 2, 4] {
        for (radius, eps) in [(8, 1e-3), (1, 1e-4), (30, 1e-2)] {
            let setting = (radius, eps, subsample);
            // One allocation for every size, as GpuStages does for its limits.
            let mut filter = guided_filter_for(&s, setting, (mw, mh));
            for (w, h) in AWKWARD {
                let image = texture(w, h, 7);
                let (a, b, alpha) = guided_differences(&l, &mut filter, setting, &image, &mask);
                let low = (w.div_ceil(subsample), h.div_ceil(subsample));
                let dp = celer::cuda::taps::mirror::resize_bound(mw, mh, low.0, low.1, 1.2);
                let dq = (1.0 + 0.5 / eps.sqrt()) * dp;
                let share_bound = 2.0 * 255.0 * f64::from(dq) * 100.0;
                let line = format!(
                    "texture {w}x{h} r={radius} eps={eps} s={subsample}: mean_a {a}; mean_b {b}; alpha {alpha} (bound {share_bound:.3}%)"
                );
                let _ = writeln!(std::io::stderr(), "fast guided filter {line}");
                if alpha.max > 1 || alpha.percent() > share_bound {
                    failed.push(line);
                }
            }
        }
    }
    assert!(
        failed.is_empty(),
        "beyond the bound:\n{}",
        failed.join("\n")
    );
}

#[test]
fn luma_and_composite_match_the_cpu() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    for (w, h) in AWKWARD {
        let n = (w * h) as usize;
        let image = texture(w, h, 7);
        let rgb = up(&s, image.as_raw());
        let mut luma = zeros::<f32>(&s, n);
        l.luma(&rgb, n as u32, &mut luma).unwrap();
        let guide = guided_filter::luma(image.as_raw(), w, h);
        assert_eq!(down(&s, &luma, n), guide.data, "luma {w}x{h}");

        // Composite of a refined plane (the matting model's path): exact.
        let t = GrayImage::from_fn(w, h, |x, y| {
            image::Luma([[0u8, 128, 255][((x + y) % 3) as usize]])
        });
        let refined = Plane::new(
            w,
            h,
            unit_pattern(n, 9).iter().map(|v| v * 1.2 - 0.1).collect(),
        );
        for use_trimap in [true, false] {
            let mut want_a = composite::quantize_alpha(&refined);
            if use_trimap {
                // Certain trimap pixels override the refinement.
                for (a, &tv) in want_a.iter_mut().zip(t.as_raw()) {
                    *a = match tv {
                        255 => 255,
                        0 => 0,
                        _ => *a,
                    };
                }
            }
            let want_rgba = composite::cutout(&image, &want_a);
            let (mut alpha, mut rgba) = (zeros::<u8>(&s, n), zeros::<u8>(&s, 4 * n));
            l.composite(
                &up(&s, &refined.data),
                &up(&s, t.as_raw()),
                use_trimap,
                n as u32,
                &mut alpha,
                Some((&rgb, &mut rgba)),
            )
            .unwrap();
            assert_eq!(&down(&s, &alpha, n), want_a.as_raw(), "alpha {w}x{h}");
            assert_eq!(&down(&s, &rgba, 4 * n), want_rgba.as_raw(), "rgba {w}x{h}");
        }
    }
}

fn repo(path: &str) -> PathBuf {
    // The packed gpu-check folder sets CELER_REPO_ROOT; a checkout uses its own root.
    std::env::var_os("CELER_REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join(path)
}

/// The largest |a - b| over two planes.
fn max_difference(a: &[u8], b: &[u8]) -> u8 {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}

fn compare_pipelines(dir: &Path, images: &[(String, RgbImage)]) {
    let spec = PipelineSpec::load_dir(dir).expect("pipeline description");
    compare_pipelines_on(&spec, images);
}

fn compare_pipelines_on(spec: &PipelineSpec, images: &[(String, RgbImage)]) {
    let dev = gpu_support::gpu();
    let mut cpu = CpuStages::load(spec, 2).expect("CPU pipeline");
    let blocks = gpu_support::blocks(&dev);
    let mut gpu = GpuStages::load(
        spec,
        dev,
        ModelSource::OnnxRuntime { intra_threads: 2 },
        GpuLimits {
            max_pixels: 4032 * 3024,
            max_side_px: 4032,
        },
        blocks,
    )
    .expect("GPU pipeline");
    for (name, image) in images {
        let want = cpu.run(image, &mut StageTimings::default()).unwrap();
        let got = gpu
            .run(
                &gpu_support::pixels(image),
                Planes::ALL,
                &mut StageTimings::default(),
            )
            .unwrap();
        assert_eq!(
            gpu_support::plane(&got.trimap),
            Some(celer::pixels::into_image(want.trimap.clone())),
            "{name}: trimap"
        );
        let got_alpha = got.alpha.as_ref().expect("alpha asked for");
        let worst = max_difference(got_alpha.as_raw(), want.alpha.as_raw());
        let differ = got_alpha
            .as_raw()
            .iter()
            .zip(want.alpha.as_raw().iter())
            .filter(|(a, b)| a != b)
            .count();
        let _ = writeln!(
            std::io::stderr(),
            "{name} ({}x{}): {differ} alpha values differ, max {worst}",
            image.width(),
            image.height()
        );
        // Every stage moves the alpha by far less than an 8-bit step, so by at most 1 LSB,
        // on a share of pixels of at most 0.5% (the guided filter at eps = 1e-3 with a
        // 320x320 mask, `fast_guided_filter_matches_the_cpu_stage`; a matting model's
        // resized alpha: 0.03%, `plane_resize_is_held_to_the_cpu`), or one pixel of a
        // tiny image. Measured: at most 1392 of 12192768 (0.011%, a texture through the
        // guided filter at subsample 4; 46 through the matting model); the photos through
        // U2NetP at most 12 pixels (photo-4032x3024.jpg).
        assert!(worst <= 1, "{name}: alpha differs by {worst}");
        let pixels = want.alpha.as_raw().len() as f64;
        assert!(
            differ as f64 <= (pixels * 0.005).max(1.0),
            "{name}: {differ} alpha values differ"
        );
        let cut = gpu_support::plane(&got.cutout).expect("cut-out asked for");
        assert_eq!(
            cut.as_raw(),
            composite::cutout(image, &gpu_support::plane(&got.alpha).unwrap()).as_raw(),
            "{name}: cut-out"
        );
    }
}

#[test]
fn gpu_pipeline_matches_cpu_pipeline_on_the_fixtures() {
    let images: Vec<(String, RgbImage)> = AWKWARD
        .iter()
        .map(|&(w, h)| (format!("texture {w}x{h}"), texture(w, h, 11)))
        .collect();
    compare_pipelines(&repo("onnx/fixtures/classes-matting"), &images);
    // The guided filter at the fixture's settings and at every subsample served.
    let guided = PipelineSpec::load_dir(&repo("onnx/fixtures/prob-guided")).expect("fixture");
    assert!(matches!(guided.matting, MattingSpec::GuidedFilter { .. }));
    for subsample in [1, 2, 4] {
        let mut spec = guided.clone();
        if let MattingSpec::GuidedFilter { subsample: s, .. } = &mut spec.matting {
            *s = subsample;
        }
        compare_pipelines_on(&spec, &images);
    }
}

#[test]
fn gpu_pipeline_matches_cpu_pipeline_on_u2netp_and_photos() {
    let model = repo("onnx/u2netp/u2netp.onnx");
    assert!(
        model.is_file(),
        "{} is missing: run `make models`",
        model.display()
    );
    compare_pipelines(&repo("onnx/u2netp"), &photos());
}

/// The GPU's plan for the fixture in `dir`: its engines where the TensorRT tests built
/// them, ONNX Runtime otherwise.
fn plan_on(
    spec: &PipelineSpec,
    dir: &Path,
    dev: &celer::cuda::GpuDevice,
) -> celer::engines::plan::GpuPlan {
    celer::engines::plan::plan_gpus(
        spec,
        dir,
        &celer::engines::dirs::EngineDirs::resolve(dir, None, false).unwrap(),
        std::slice::from_ref(&dev.info),
        false,
        None,
    )
    .expect("a plan for the GPU (engines are built by the TensorRT tests, not here)")
    .into_iter()
    .next()
    .expect("one GPU, one plan")
}

/// The GPU as `celer serve` starts it: planned (ONNX Runtime for the models where
/// TensorRT is absent, engines where present and built), loaded by the router's replica
/// threads, and asked for cut-outs through the router. Same trimap as the CPU pipeline,
/// alpha within 1 LSB, and the device's cut-out composited from its own alpha.
#[test]
fn a_gpu_device_serves_through_the_router_like_the_cpu() {
    use celer::replica::gpu::gpu_device_setup;
    use celer::sched::{Scheduler, SchedulerConfig};

    let dev = gpu_support::gpu();
    let dir = repo("onnx/fixtures/classes-matting");
    let spec = PipelineSpec::load_dir(&dir).expect("fixture");
    let plan = plan_on(&spec, &dir, &dev);
    let _ = writeln!(std::io::stderr(), "GPU models: {:?}", plan.models);
    let setup = gpu_device_setup(
        &spec,
        plan,
        2,
        2,
        celer::replica::gpu::GpuServing::new(GpuLimits::default(), gpu_support::pool(&dev)),
    );
    let router = Scheduler::start(vec![setup], SchedulerConfig::default());
    router.wait_ready().expect("the GPU replicas load");
    let waiter = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let mut cpu = CpuStages::load(&spec, 2).expect("CPU pipeline");
    for (w, h) in AWKWARD {
        let texture = texture(w, h, 5);
        let image = gpu_support::pixels(&texture);
        let ticket = gpu_support::submit(&router, &image, Planes::ALL).expect("admitted");
        let done = waiter.block_on(ticket.wait()).expect("served");
        let want = cpu.run(&texture, &mut StageTimings::default()).unwrap();
        let got = done.output;
        assert_eq!(
            gpu_support::plane(&got.planes.trimap),
            Some(celer::pixels::into_image(want.trimap.clone())),
            "{w}x{h}: trimap"
        );
        let got_alpha = got.planes.alpha.as_ref().expect("alpha asked for");
        let worst = max_difference(got_alpha.as_raw(), want.alpha.as_raw());
        assert!(worst <= 1, "{w}x{h}: alpha differs by {worst}");
        // The GPU stages' times come from CUDA events: recorded, not left at zero.
        assert!(
            got.timings.trimap > std::time::Duration::ZERO
                && got.timings.matting + got.timings.composite > std::time::Duration::ZERO,
            "{w}x{h}: GPU stage times not recorded: {:?}",
            got.timings
        );
        assert_eq!(
            gpu_support::plane(&got.planes.cutout)
                .expect("the GPU makes the cut-out it was asked for")
                .as_raw(),
            composite::cutout(&texture, &gpu_support::plane(&got.planes.alpha).unwrap()).as_raw(),
            "{w}x{h}: cut-out"
        );
    }
    router.shutdown();
}

/// `--warmup-size` on a GPU: each replica runs the size at load and once more, timed, so
/// the device has prices before its first request; without it, none until a request ran.
#[test]
fn a_gpu_device_warmed_up_at_a_size_is_priced_before_its_first_request() {
    use celer::replica::gpu::{gpu_device_setup, GpuServing};
    use celer::sched::{Scheduler, SchedulerConfig};

    let dev = gpu_support::gpu();
    let dir = repo("onnx/fixtures/classes-matting");
    let spec = PipelineSpec::load_dir(&dir).expect("fixture");
    let priced = |warmup: Vec<(u32, u32)>| {
        let serving = GpuServing {
            warmup,
            ..GpuServing::new(GpuLimits::default(), gpu_support::pool(&dev))
        };
        let setup = gpu_device_setup(&spec, plan_on(&spec, &dir, &dev), 2, 2, serving);
        let router = Scheduler::start(vec![setup], SchedulerConfig::default());
        router.wait_ready().expect("the GPU replicas load");
        let prices = router.devices()[0].prices;
        router.shutdown();
        prices
    };
    let warmed = priced(vec![(200, 150)]).expect("priced from the warm-up's timed runs");
    assert!(warmed.fixed_s > 0.0, "{warmed:?}");
    assert_eq!(priced(Vec::new()), None);
}

/// Every one of the 65536 float16 values converts as the half crate converts it (an
/// engine's float16 output becomes the f32 plane the trimap reads).
#[test]
fn f16_to_f32_is_exact_for_every_half() {
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let all: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
    let src = up(&s, &all);
    let mut dst = zeros::<f32>(&s, all.len());
    Launcher {
        stream: &s,
        kernels: dev.kernels(),
    }
    .f16_to_f32(&src, all.len(), &mut dst)
    .unwrap();
    let got = down(&s, &dst, all.len());
    for (h, g) in all.iter().zip(&got) {
        assert_eq!(
            g.to_bits(),
            h.to_f32().to_bits(),
            "half bits {:#06x}",
            h.to_bits()
        );
    }
}

/// The GPU's context waits for the GPU by sleeping, not by spinning a core: the cores stay
/// free for decode, encode and ONNX Runtime while replicas wait for their streams.
#[test]
fn the_context_synchronises_by_blocking_not_spinning() {
    let dev = gpu_support::gpu();
    let flags = dev.context().flags().expect("cuCtxGetFlags");
    let schedule = flags & 0x07;
    assert_eq!(
        schedule,
        celer::cuda::driver::sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC as u32,
        "context flags {flags:#x}"
    );
}
