//! Kernel benchmark: each CUDA kernel at 1920x1080 and at 12 MP, 4032x3024 (GPU time from
//! CUDA events, achieved GB/s and its fraction of the device's peak memory bandwidth from
//! the probe), then the whole pre- and post-processing of a 1920x1080 request with upload
//! and download, side by side with the CPU stages it replaces. Without a GPU it says so
//! and exits 0.
//!
//! Before any timing (and without a GPU too) it prints the launch shapes of the guided
//! filter's fit at 4032x3024 for subsample 1 and 4, and how many SMs of a 132-SM
//! H100/H200 their blocks would occupy.
//!
//! `cargo bench --bench cuda_kernels`; `CELER_BENCH_JSON=path` also writes the figures
//! as JSON, `CELER_BENCH_ITERS=n` times each kernel n times instead of 20 (the packed
//! check's quick run on the stand-in driver). Two more modes for `make gpu-check`
//! (scripts/gpu-check): `--counts` (what a request asks of the driver, counts.rs) and
//! `--compile-planted DIR [sm_XY,...]` (the planted test kernels of tests/gpu_recovery.rs
//! precompiled for a GPU machine without NVRTC).

#[path = "cuda_kernels/counts.rs"]
mod counts;
#[path = "../tests/gpu_support/planted.rs"]
mod planted;

use std::sync::Arc;
use std::time::Instant;

use celer::cuda::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use celer::cuda::guided::{FastGuidedFilter, GuidedParams};
use celer::cuda::launch::{
    guided_fit_launches, taps_capacity, GpuNearest, GpuTaps, Launcher, ModelInput,
};
use celer::cuda::{probe, Arch, GpuDevice, GpuInfo, Probe};
use celer::spec::{Normalize, Scale};
use celer::stages::lanes::Lanes;
use celer::stages::plane::Plane;
use celer::stages::{composite, guided_filter, preprocess, resample, trimap};
use fast_image_resize::Resizer;
use image::{Rgb, RgbImage};
use serde_json::json;

/// GPU timings per kernel (the median is reported), unless `CELER_BENCH_ITERS` says fewer.
const ITERS: usize = 20;
/// CPU timings per stage.
const CPU_ITERS: usize = 5;

/// `default` iterations, or `CELER_BENCH_ITERS` where that is fewer (at least one).
fn iterations(default: usize) -> usize {
    std::env::var("CELER_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(default, |n| n.clamp(1, default))
}

/// The sizes each kernel is timed at: a 1080p frame and a 12 MP photo.
const KERNEL_SIZES: [(u32, u32); 2] = [(1920, 1080), (4032, 3024)];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--compile-planted") {
        std::process::exit(compile_planted(&args[i + 1..]));
    }
    if args.iter().any(|a| a == "--counts") {
        std::process::exit(match counts::run() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("cuda_kernels --counts: {e}");
                1
            }
        });
    }
    let launches = fit_launch_shapes();
    let gpus = match probe() {
        Probe::Ready { gpus, .. } if !gpus.is_empty() => gpus,
        other => {
            println!(
                "cuda_kernels: no GPU ({}): nothing to time",
                other.summary()
            );
            write_json(&json!({
                "gpu": null,
                "reason": other.summary(),
                "guided_fit_launches": launches,
            }));
            return;
        }
    };
    let info = gpus[0].clone();
    let dev = match GpuDevice::open(info.clone()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cuda_kernels: cannot open GPU 0: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "GPU 0: {} (sm_{}{}), peak memory bandwidth {:.0} GB/s ({} kHz x {} bit)",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.peak_bandwidth_bytes_per_s() / 1e9,
        info.memory_clock_khz,
        info.memory_bus_width_bits
    );
    let mut figures = serde_json::Map::new();
    figures.insert("gpu".into(), json!(info));
    figures.insert("iterations".into(), json!(iterations(ITERS)));
    for (w, h) in KERNEL_SIZES {
        let rows = time_kernels(&dev, &info, (w, h));
        figures.insert(format!("kernels_{w}x{h}"), json!(rows));
    }
    figures.insert("pre_post_1920x1080".into(), time_pre_post(&dev));
    figures.insert("guided_fit_launches".into(), json!(launches));
    write_json(&serde_json::Value::Object(figures));
}

/// SMs of an H100 / H200 (SXM), for the occupancy estimate of the launch shapes.
const H100_SMS: u64 = 132;

/// Prints (and returns) the guided filter fit's four launches at 4032x3024 for subsample
/// 1 and 4: threads, threads per block, blocks, and the SMs of a 132-SM GPU those blocks
/// occupy (the block scheduler puts each block on its own SM while there are SMs free).
fn fit_launch_shapes() -> Vec<serde_json::Value> {
    let source = (4032u32, 3024u32);
    println!(
        "guided filter fit launches for a {}x{} source ({H100_SMS}-SM H100/H200 estimate)",
        source.0, source.1
    );
    println!(
        "{:<5} {:<10} {:<26} {:>8} {:>6} {:>7} {:>9}",
        "s", "fit size", "kernel", "threads", "block", "blocks", "SMs busy"
    );
    let mut out = Vec::new();
    for subsample in [1u32, 4] {
        let params = GuidedParams {
            radius: 8,
            epsilon: 1e-3,
            subsample,
        };
        let (lw, lh) = params.low_size(source);
        for launch in guided_fit_launches((lw, lh)) {
            let blocks = launch.blocks();
            let busy = blocks.min(H100_SMS);
            println!(
                "{:<5} {:<10} {:<26} {:>8} {:>6} {:>7} {:>4}/{H100_SMS}",
                subsample,
                format!("{lw}x{lh}"),
                launch.kernel,
                launch.threads,
                launch.block,
                blocks,
                busy
            );
            out.push(json!({
                "subsample": subsample,
                "fit_size": [lw, lh],
                "kernel": launch.kernel,
                "threads": launch.threads,
                "block": launch.block,
                "blocks": blocks,
                "sms_busy_of_132": busy,
            }));
        }
    }
    println!();
    out
}

/// `--compile-planted DIR [sm_XY,...]`: the planted kernels compiled with every NVRTC
/// found into DIR (tests/gpu_support/planted.rs reads them there); an exit status.
fn compile_planted(args: &[String]) -> i32 {
    let Some(dir) = args.first() else {
        eprintln!("usage: cuda_kernels --compile-planted DIR [sm_XY,...]");
        return 2;
    };
    let archs: Result<Vec<Arch>, _> = args
        .get(1)
        .map(|list| list.split(',').map(str::parse).collect())
        .unwrap_or_else(|| Ok(Vec::new()));
    let written = archs
        .map_err(|e| e.to_string())
        .and_then(|archs| planted::compile_all_into(std::path::Path::new(dir), &archs));
    match written {
        Ok(lines) => {
            lines.iter().for_each(|line| println!("{line}"));
            0
        }
        Err(e) => {
            eprintln!("cuda_kernels --compile-planted: {e}");
            1
        }
    }
}

fn write_json(value: &serde_json::Value) {
    if let Some(path) = std::env::var_os("CELER_BENCH_JSON") {
        if let Err(e) = std::fs::write(&path, serde_json::to_vec_pretty(value).unwrap_or_default())
        {
            eprintln!("cannot write {}: {e}", path.to_string_lossy());
        }
    }
}

fn texture(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v =
            (x.wrapping_mul(73_856_093) ^ y.wrapping_mul(19_349_663)).wrapping_mul(2_654_435_761);
        Rgb([(v >> 24) as u8, (v >> 16) as u8, ((x * 255) / w) as u8])
    })
}

fn mask(w: u32, h: u32) -> Vec<f32> {
    // A soft disc: a realistic mix of certain and unknown pixels.
    (0..h)
        .flat_map(|y| {
            (0..w).map(move |x| {
                let (dx, dy) = (x as f32 / w as f32 - 0.5, y as f32 / h as f32 - 0.5);
                (1.0 - ((dx * dx + dy * dy).sqrt() - 0.3) * 20.0).clamp(0.0, 1.0)
            })
        })
        .collect()
}

/// GPU milliseconds per call of `f` (median of [`ITERS`], after one warm-up).
fn gpu_ms(dev: &GpuDevice, s: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    f();
    let start = dev.timing_event().unwrap();
    let end = dev.timing_event().unwrap();
    let iters = iterations(ITERS);
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            start.record(s).unwrap();
            f();
            end.record(s).unwrap();
            end.synchronize().unwrap();
            f64::from(start.elapsed_ms(&end).unwrap())
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[iters / 2]
}

fn cpu_ms(mut f: impl FnMut()) -> f64 {
    f();
    let iters = iterations(CPU_ITERS);
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[iters / 2]
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    s.alloc_zeros(n.max(1)).unwrap()
}

/// Each kernel on a `w` x `h` source (the model's side 320), as a request of that size
/// runs it.
fn time_kernels(dev: &GpuDevice, info: &GpuInfo, (w, h): (u32, u32)) -> Vec<serde_json::Value> {
    let n = (w * h) as usize;
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    let image = texture(w, h);
    let rgb = s.clone_htod(image.as_raw()).unwrap();
    let norm = Normalize {
        scale: Scale::ImageMax,
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };
    let (oh, wh) = taps_capacity(w, 320);
    let mut ht = GpuTaps::<i32>::alloc(&s, oh, wh).unwrap();
    let mut vt = GpuTaps::<i32>::alloc(&s, oh, wh).unwrap();
    ht.set_fixed(&l, w, 320).unwrap();
    vt.set_fixed(&l, h, 320).unwrap();
    let (mut tmp, mut resized, mut max, mut input) = (
        zeros::<u8>(&s, 320 * h as usize * 3),
        zeros::<u8>(&s, 320 * 320 * 3),
        zeros::<u32>(&s, 1),
        zeros::<f32>(&s, 320 * 320 * 3),
    );
    let small = mask(320, 320);
    let dmask = s.clone_htod(&small).unwrap();
    let (mut lohi, mut coarse, mut tri_small, mut flags) = (
        zeros::<u32>(&s, 2),
        zeros::<f32>(&s, 320 * 320),
        zeros::<u8>(&s, 320 * 320),
        zeros::<u8>(&s, 320 * 320),
    );
    let mut nearest = GpuNearest::alloc(&s, w, h).unwrap();
    nearest.set(&l, (320, 320), (w, h)).unwrap();
    let mut trimap_full = zeros::<u8>(&s, n);
    let (ch, cwh) = taps_capacity(320, w);
    let mut pht = GpuTaps::<f32>::alloc(&s, ch, cwh).unwrap();
    let mut pvt = GpuTaps::<f32>::alloc(&s, ch, cwh).unwrap();
    pht.set_convolution(&l, 320, w).unwrap();
    pvt.set_convolution(&l, 320, h).unwrap();
    let (mut ptmp, mut p, mut luma) = (
        zeros::<f32>(&s, w as usize * 320),
        zeros::<f32>(&s, n),
        zeros::<f32>(&s, n),
    );
    // The fast guided filter as served (radius 8, subsample 4), and the classic one.
    let served = GuidedParams {
        radius: 8,
        epsilon: 1e-3,
        subsample: 4,
    };
    let classic = GuidedParams {
        subsample: 1,
        ..served
    };
    let mut fast = FastGuidedFilter::alloc(&s, served, n as u64, w, (320, 320)).unwrap();
    let mut full = FastGuidedFilter::alloc(&s, classic, n as u64, w, (320, 320)).unwrap();
    let (mut alpha, mut rgba) = (zeros::<u8>(&s, n), zeros::<u8>(&s, 4 * n));
    // Prime the buffers the later stages read.
    l.probability_trimap(
        &dmask,
        (320, 320),
        true,
        0.94,
        0.04,
        &mut lohi,
        &mut coarse,
        &mut tri_small,
    )
    .unwrap();
    l.resize_nearest(&tri_small, &nearest, &mut trimap_full)
        .unwrap();
    fast.fit(&l, &rgb, (w, h), &coarse, (320, 320)).unwrap();
    full.fit(&l, &rgb, (w, h), &coarse, (320, 320)).unwrap();
    s.synchronize().unwrap();
    // The share of unknown pixels, which the alpha pass evaluates the model at.
    let band = s
        .clone_dtoh(&trimap_full)
        .map(|t| t[..n].iter().filter(|&&v| v != 0 && v != 255).count())
        .unwrap_or(0) as f64;
    println!(
        "\ntrimap: {:.1}% of the {w}x{h} pixels unknown",
        100.0 * band / n as f64
    );

    let nb = n as f64;
    let (wf, hf) = (f64::from(w), f64::from(h));
    let (low_w, low_h) = served.low_size((w, h));
    let low = f64::from(low_w) * f64::from(low_h);
    let preprocess_name = format!("preprocess {w}x{h} -> 320x320 (resize + max + normalise)");
    let nearest_name = format!("trimap NEAREST 320x320 -> {w}x{h}");
    let bilinear = format!("mask bilinear 320x320 -> {w}x{h} (f32)");
    let luma_name = format!("luma {w}x{h}");
    let fit_name = format!("fast guided filter fit r=8 s=4 (at {low_w}x{low_h})");
    let composite_name = format!("composite of a plane: alpha + RGBA cut-out {w}x{h}");
    // (name, bytes read + written, GPU ms)
    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    rows.push((
        &preprocess_name,
        nb * 3.0 + 320.0 * hf * 3.0 * 2.0 + 320.0 * 320.0 * 3.0 * 6.0,
        gpu_ms(dev, &s, || {
            l.preprocess(
                &rgb,
                (w, h),
                &ht,
                &vt,
                (320, 320),
                &norm,
                &mut tmp,
                &mut resized,
                &mut max,
                ModelInput::F32(&mut input),
            )
            .unwrap()
        }),
    ));
    rows.push((
        "mask -> trimap 320x320 (minmax + threshold + erode r=2)",
        320.0 * 320.0 * (4.0 * 2.0 + 4.0 + 1.0 + 3.0),
        gpu_ms(dev, &s, || {
            l.probability_trimap(
                &dmask,
                (320, 320),
                true,
                0.94,
                0.04,
                &mut lohi,
                &mut coarse,
                &mut tri_small,
            )
            .unwrap();
            l.erode(&mut tri_small, (320, 320), 2, &mut flags).unwrap();
        }),
    ));
    rows.push((
        &nearest_name,
        nb,
        gpu_ms(dev, &s, || {
            l.resize_nearest(&tri_small, &nearest, &mut trimap_full)
                .unwrap()
        }),
    ));
    rows.push((
        &bilinear,
        4.0 * (wf * 320.0 * 2.0 + nb),
        gpu_ms(dev, &s, || {
            l.resize_plane(&coarse, (320, 320), &pht, &pvt, &mut ptmp, &mut p)
                .unwrap()
        }),
    ));
    rows.push((
        &luma_name,
        nb * 7.0,
        gpu_ms(dev, &s, || l.luma(&rgb, n as u32, &mut luma).unwrap()),
    ));
    // Fit at 1/4: guide resize (read the source, write 1/16), mask resize, luma, and
    // the four box passes over 1/16 of the pixels.
    let fit_bytes = nb * 3.0
        + wf * hf * 3.0 * 2.0 / 4.0
        + low * (3.0 + 3.0 + 4.0 + 4.0)
        + 4.0 * low * (4.0 + 2.0 + 4.0 + 4.0 + 2.0 + 2.0 + 2.0 + 2.0);
    rows.push((
        &fit_name,
        fit_bytes,
        gpu_ms(dev, &s, || {
            fast.fit(&l, &rgb, (w, h), &coarse, (320, 320)).unwrap()
        }),
    ));
    // Apply: trimap everywhere; RGB and the model only in the band; alpha + RGBA out.
    let apply_bytes = nb * (1.0 + 1.0 + 4.0) + band * 3.0 + low * 8.0;
    rows.push((
        "fast guided filter apply s=4: alpha + RGBA cut-out",
        apply_bytes,
        gpu_ms(dev, &s, || {
            fast.alpha(&l, &rgb, (w, h), &trimap_full, &mut alpha, Some(&mut rgba))
                .unwrap()
        }),
    ));
    rows.push((
        "guided filter fit r=8 s=1 (classic, full size)",
        nb * 3.0 + nb * 4.0 + 4.0 * nb * (4.0 + 2.0 + 4.0 + 4.0 + 2.0 + 2.0 + 2.0 + 2.0),
        gpu_ms(dev, &s, || {
            full.fit(&l, &rgb, (w, h), &coarse, (320, 320)).unwrap()
        }),
    ));
    rows.push((
        "guided filter apply s=1: alpha + RGBA cut-out",
        nb * (1.0 + 1.0 + 4.0) + band * 3.0 + band * 8.0,
        gpu_ms(dev, &s, || {
            full.alpha(&l, &rgb, (w, h), &trimap_full, &mut alpha, Some(&mut rgba))
                .unwrap()
        }),
    ));
    rows.push((
        &composite_name,
        nb * (4.0 + 1.0 + 3.0 + 1.0 + 4.0),
        gpu_ms(dev, &s, || {
            l.composite(
                &p,
                &trimap_full,
                true,
                n as u32,
                &mut alpha,
                Some((&rgb, &mut rgba)),
            )
            .unwrap()
        }),
    ));

    let peak = info.peak_bandwidth_bytes_per_s();
    println!(
        "{:<62} {:>9} {:>9} {:>8}",
        format!("kernel ({w}x{h} source)"),
        "GPU ms",
        "GB/s",
        "of peak"
    );
    rows.iter()
        .map(|(name, bytes, ms)| {
            let gbs = bytes / (ms / 1e3) / 1e9;
            println!("{name:<62} {ms:>9.3} {gbs:>9.1} {:>7.1}%", 100.0 * gbs * 1e9 / peak);
            json!({ "kernel": name, "gpu_ms": ms, "bytes": bytes, "gb_per_s": gbs, "fraction_of_peak": gbs * 1e9 / peak })
        })
        .collect()
}

/// The whole pre- and post-processing of one 1920x1080 request (the model excluded):
/// GPU with upload and download, against the CPU stages.
fn time_pre_post(dev: &GpuDevice) -> serde_json::Value {
    let (w, h) = (1920u32, 1080u32);
    let n = (w * h) as usize;
    let image = texture(w, h);
    let small = Plane::new(320, 320, mask(320, 320));
    let norm = Normalize {
        scale: Scale::ImageMax,
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };
    let (radius, eps, erode) = (8u32, 1e-3f32, 2u32);

    // CPU: the stages `Pipeline::run` and `render` call.
    let mut resizer = Resizer::new();
    let (mut resized, mut input) = (Vec::new(), vec![0f32; 320 * 320 * 3]);
    let cpu_pre = cpu_ms(|| {
        preprocess::resize_rgb(&image, 320, 320, &mut resized);
        preprocess::normalize_into(&resized, &norm, &mut input);
    });
    let cpu_post = cpu_ms(|| {
        let mut t = trimap::threshold(&small, 0.94, 0.04);
        trimap::erode(&mut t, erode);
        let full = resample::resize_nearest(&t, w, h);
        // The CPU stage as served: the fast guided filter (subsample 4).
        let a = guided_filter::fit(Lanes::ONE, &mut resizer, &image, &small, radius, eps, 4)
            .unwrap()
            .alpha(Lanes::ONE, &image, &full);
        std::hint::black_box(composite::cutout(&image, &a));
    });

    // GPU: upload, all kernels, download of alpha + trimap + RGBA, one sync each half.
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    // Pinned staging, as GpuStages has.
    let ctx = dev.context();
    let mut up_host = celer::cuda::pinned::<u8>(ctx, n * 3, false).expect("pinned memory");
    let mut down_host = celer::cuda::pinned::<u8>(ctx, n * 6, false).expect("pinned memory");
    let mut rgb = zeros::<u8>(&s, n * 3);
    let (oh, wh) = taps_capacity(w, 320);
    let mut ht = GpuTaps::<i32>::alloc(&s, oh, wh).unwrap();
    let mut vt = GpuTaps::<i32>::alloc(&s, oh, wh).unwrap();
    ht.set_fixed(&l, w, 320).unwrap();
    vt.set_fixed(&l, h, 320).unwrap();
    let (mut tmp, mut dresized, mut max, mut dinput) = (
        zeros::<u8>(&s, 320 * h as usize * 3),
        zeros::<u8>(&s, 320 * 320 * 3),
        zeros::<u32>(&s, 1),
        zeros::<f32>(&s, 320 * 320 * 3),
    );
    let mut host_input = vec![0f32; 320 * 320 * 3];
    let mut dmask = s.clone_htod(&small.data).unwrap();
    let (mut lohi, mut coarse, mut tri_small, mut flags) = (
        zeros::<u32>(&s, 2),
        zeros::<f32>(&s, 320 * 320),
        zeros::<u8>(&s, 320 * 320),
        zeros::<u8>(&s, 320 * 320),
    );
    let mut nearest = GpuNearest::alloc(&s, w, h).unwrap();
    nearest.set(&l, (320, 320), (w, h)).unwrap();
    let mut trimap_full = zeros::<u8>(&s, n);
    let params = GuidedParams {
        radius,
        epsilon: eps,
        subsample: 4,
    };
    let mut filter = FastGuidedFilter::alloc(&s, params, n as u64, w, (320, 320)).unwrap();
    let (mut alpha, mut rgba) = (zeros::<u8>(&s, n), zeros::<u8>(&s, 4 * n));

    let gpu_pre = cpu_ms(|| {
        let host = up_host.as_mut_slice();
        host.copy_from_slice(image.as_raw());
        s.memcpy_htod(up_host.as_slice(), &mut rgb).unwrap();
        l.preprocess(
            &rgb,
            (w, h),
            &ht,
            &vt,
            (320, 320),
            &norm,
            &mut tmp,
            &mut dresized,
            &mut max,
            ModelInput::F32(&mut dinput),
        )
        .unwrap();
        s.memcpy_dtoh(&dinput, &mut host_input).unwrap();
        s.synchronize().unwrap();
    });
    let gpu_post = cpu_ms(|| {
        s.memcpy_htod(&small.data, &mut dmask).unwrap();
        l.probability_trimap(
            &dmask,
            (320, 320),
            false,
            0.94,
            0.04,
            &mut lohi,
            &mut coarse,
            &mut tri_small,
        )
        .unwrap();
        l.erode(&mut tri_small, (320, 320), erode, &mut flags)
            .unwrap();
        l.resize_nearest(&tri_small, &nearest, &mut trimap_full)
            .unwrap();
        filter.fit(&l, &rgb, (w, h), &coarse, (320, 320)).unwrap();
        filter
            .alpha(&l, &rgb, (w, h), &trimap_full, &mut alpha, Some(&mut rgba))
            .unwrap();
        let host = down_host.as_mut_slice();
        let (a, rest) = host.split_at_mut(n);
        let (t, rest) = rest.split_at_mut(n);
        s.memcpy_dtoh(&alpha, a).unwrap();
        s.memcpy_dtoh(&trimap_full, t).unwrap();
        s.memcpy_dtoh(&rgba, &mut rest[..4 * n]).unwrap();
        s.synchronize().unwrap();
    });
    println!("\npre + post of one 1920x1080 request, model excluded (wall ms, median)");
    println!(
        "{:<44} {:>9} {:>9} {:>8}",
        "stage", "CPU", "GPU", "speed-up"
    );
    for (name, c, g) in [
        ("preprocess (+ upload, + input download)", cpu_pre, gpu_pre),
        (
            "post: trimap, fast guided filter s=4, cut-out (+ download)",
            cpu_post,
            gpu_post,
        ),
    ] {
        println!("{name:<44} {c:>9.2} {g:>9.2} {:>7.1}x", c / g);
    }
    json!({
        "cpu_preprocess_ms": cpu_pre, "gpu_preprocess_ms": gpu_pre,
        "cpu_post_ms": cpu_post, "gpu_post_ms": gpu_post,
        "cpu_threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    })
}
