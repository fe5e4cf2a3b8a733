//! Every CUDA kernel against its CPU stage, and `GpuStages` against `Pipeline`, on a
//! GPU: the real one where there is a CUDA driver, celer's stand-in driver otherwise
//! (tests/gpu_support). Nothing here skips: a test that gets no GPU fails.
//!
//! Tolerances: preprocess (f32 and f16), trimap, erosion, NEAREST and composite are
//! exact. The f32 plane resize is exact on an AVX2 host (the CPU stage's summation order)
//! and within 1 ulp elsewhere. The fast guided filter's fit (mask resize, guide resize,
//! box means in the CPU's f64 running-sum order, no FMA) is asserted bit-exact on an AVX2
//! host; its alpha step on the CPU's own model is asserted exact everywhere; the alpha
//! of fit + apply within 1 LSB. The pipelines agree exactly on the trimap and within
//! 1 LSB on alpha.

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

#[test]
fn plane_resize_matches_fast_image_resize() {
    let dev = gpu_support::gpu();
    let exact = cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx2");
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    for ((w, h), (dw, dh)) in [
        ((320, 320), (4032, 3024)),
        ((320, 320), (1, 1)),
        ((320, 320), (333, 517)),
        ((7, 5), (3, 2)),
        ((1, 1), (1918, 1077)),
        ((320, 320), (320, 320)),
    ] {
        let src = Plane::new(w, h, unit_pattern((w * h) as usize, dw));
        let want = resample::resize_plane(&mut Resizer::new(), &src, dw, dh).unwrap();
        let (oh, wh) = taps_capacity(w, dw);
        let (ov, wv) = taps_capacity(h, dh);
        let mut ht = GpuTaps::<f64>::alloc(&s, oh, wh).unwrap();
        let mut vt = GpuTaps::<f64>::alloc(&s, ov, wv).unwrap();
        ht.set_convolution(&s, w, dw).unwrap();
        vt.set_convolution(&s, h, dh).unwrap();
        let mut tmp = zeros::<f32>(&s, (dw * h) as usize);
        let mut dst = zeros::<f32>(&s, (dw * dh) as usize);
        l.resize_plane(&up(&s, &src.data), (w, h), &ht, &vt, &mut tmp, &mut dst)
            .unwrap();
        let got = down(&s, &dst, (dw * dh) as usize);
        let worst = got
            .iter()
            .zip(&want.data)
            .map(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).abs())
            .max()
            .unwrap_or(0);
        assert!(
            worst <= if exact { 0 } else { 1 },
            "{w}x{h} -> {dw}x{dh}: {worst} ulp"
        );
    }
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

#[test]
fn fast_guided_filter_matches_the_cpu_stage() {
    let dev = gpu_support::gpu();
    let exact = cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx2");
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    let (mw, mh) = (320u32, 320u32);
    for subsample in [1, 2, 4] {
        for (radius, eps) in [(8, 1e-3), (1, 1e-4), (30, 1e-2)] {
            let params = GuidedParams {
                radius,
                epsilon: eps,
                subsample,
            };
            // One allocation for every size, as GpuStages does for its limits.
            let mut filter = FastGuidedFilter::alloc(&s, params, 4032 * 3024, 4032, (mw, mh))
                .expect("guided filter buffers");
            for (w, h) in AWKWARD {
                let n = (w * h) as usize;
                let image = texture(w, h, 7);
                // Values beyond [0, 1] too: the fit clamps them.
                let mask = Plane::new(
                    mw,
                    mh,
                    unit_pattern((mw * mh) as usize, 3)
                        .iter()
                        .map(|v| v * 1.4 - 0.2)
                        .collect(),
                );
                let trimap = banded_trimap(w, h);
                let model = guided_filter::fit(
                    Lanes::ONE,
                    &mut Resizer::new(),
                    &image,
                    &mask,
                    radius,
                    eps,
                    subsample,
                )
                .unwrap();
                let want = model.alpha(Lanes::ONE, &image, &trimap);

                let rgb = up(&s, image.as_raw());
                filter
                    .fit(&l, &rgb, (w, h), &up(&s, &mask.data), (mw, mh))
                    .unwrap();
                let fitted = filter.model().expect("fitted");
                let (lw, lh) = fitted.size;
                assert_eq!((lw, lh), (model.mean_a.width, model.mean_a.height));
                let low = (lw * lh) as usize;
                let (ga, gb) = (down(&s, fitted.mean_a, low), down(&s, fitted.mean_b, low));
                let same = |got: &[f32], want: &[f32]| {
                    got.iter()
                        .zip(want)
                        .filter(|(a, b)| a.to_bits() == b.to_bits())
                        .count()
                };
                let (same_a, same_b) =
                    (same(&ga, &model.mean_a.data), same(&gb, &model.mean_b.data));
                let mut alpha = zeros::<u8>(&s, n);
                let mut rgba = zeros::<u8>(&s, 4 * n);
                let tri = up(&s, trimap.as_raw());
                filter
                    .alpha(&l, &rgb, (w, h), &tri, &mut alpha, Some(&mut rgba))
                    .unwrap();
                let got = down(&s, &alpha, n);
                let worst = got
                    .iter()
                    .zip(want.as_raw())
                    .map(|(a, b)| a.abs_diff(*b))
                    .max()
                    .unwrap_or(0);
                let differ = got
                    .iter()
                    .zip(want.as_raw())
                    .filter(|(a, b)| a != b)
                    .count();
                let _ = writeln!(
                    std::io::stderr(),
                    "fast guided filter {w}x{h} s={subsample} r={radius}: mean_a {same_a}/{low}, mean_b {same_b}/{low} bit-identical; alpha: {differ}/{n} differ, max {worst}"
                );
                if exact {
                    assert_eq!(same_a, low, "mean_a {w}x{h} s={subsample} r={radius}");
                    assert_eq!(same_b, low, "mean_b {w}x{h} s={subsample} r={radius}");
                }
                assert!(
                    worst <= 1,
                    "alpha {w}x{h} s={subsample} r={radius}: {worst} LSB"
                );
                let got_image = GrayImage::from_raw(w, h, got).unwrap();
                assert_eq!(
                    &down(&s, &rgba, 4 * n),
                    composite::cutout(&image, &got_image).as_raw(),
                    "rgba {w}x{h}"
                );
            }
        }
    }
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
        assert!(worst <= 1, "{name}: alpha differs by {worst}");
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
    let fetched = repo("tests/data/fetched");
    assert!(
        model.is_file(),
        "{} is missing: run `make models`",
        model.display()
    );
    let images: Vec<(String, RgbImage)> = [
        "astronaut.png",
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
    .collect();
    compare_pipelines(&repo("onnx/u2netp"), &images);
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
