//! A GPU request at its floor, counted: the stand-in CUDA driver counts every launch,
//! memset, copy (and its bytes), host synchronisation and pinned allocation, and this test
//! pins, for a 1920x1080 request served from TensorRT engines (U2NetP, built now by the
//! stand-in TensorRT), exactly what the request path is designed to do. A change that adds
//! a copy, a launch or a synchronisation to the request path fails here, and says which
//! count moved; when a change removes work on purpose, the numbers here move with it.
//!
//! The design, for a cut-out: one upload (the RGB8 pixels), one download (the RGBA
//! answer: its alpha is the matte, so no separate alpha), one host synchronisation (the
//! download's), nothing pinned; for an alpha answer the download is the alpha plane.
//! Runs on the stand-in only (the counters are its own); on a real GPU it fails, saying
//! so.

mod engine_support;
mod gpu_support;
mod trt_support;

use std::collections::BTreeMap;
use std::io::Write;

use celer::matte::{Planes, StageTimings};
use celer::replica::gpu::{GpuLimits, GpuStages};
use celer_cuda_standin::StandIn;
use image::{Rgb, RgbImage};

const W: u32 = 1920;
const H: u32 = 1080;

/// The counters a request moves, by name (driver.cpp's `celer_standin_counter`).
const COUNTED: [&str; 11] = [
    "launches_enqueued",
    "memsets",
    "htod_copies",
    "htod_bytes",
    "dtoh_copies",
    "dtoh_bytes",
    "stream_syncs",
    "event_syncs",
    "ctx_syncs",
    "host_syncs",
    "pinned_allocs",
];

fn standin() -> &'static StandIn {
    gpu_support::driver().standin().expect(
        "the request-floor counts are the stand-in CUDA driver's: run on it \
         (CELER_TEST_CUDA=standin), not on a real GPU",
    )
}

fn counters(s: &StandIn) -> BTreeMap<&'static str, u64> {
    COUNTED
        .iter()
        .map(|&name| {
            let value = s.counter(name);
            assert_ne!(value, u64::MAX, "the stand-in has no counter `{name}`");
            (name, value)
        })
        .collect()
}

/// What one request of `planes` moved, by counter.
fn one_request(
    stages: &mut GpuStages,
    image: &RgbImage,
    planes: Planes,
) -> BTreeMap<&'static str, u64> {
    let s = standin();
    let before = counters(s);
    let out = stages
        .run(image, planes, &mut StageTimings::default())
        .expect("served");
    let after = counters(s);
    assert_eq!(out.cutout.is_some(), planes.cutout);
    assert_eq!(out.alpha.is_some(), planes.alpha);
    assert_eq!(out.trimap.is_some(), planes.trimap);
    let moved: BTreeMap<_, _> = after.iter().map(|(k, v)| (*k, v - before[k])).collect();
    let _ = writeln!(std::io::stderr(), "{planes:?}: {moved:?}");
    moved
}

fn photo() -> RgbImage {
    RgbImage::from_fn(W, H, |x, y| {
        let inside = (600..1300).contains(&x) && (200..900).contains(&y);
        let v = if inside { 210 } else { 40 };
        Rgb([v, (v as u32 + x % 17) as u8, (v as u32 + y % 13) as u8])
    })
}

#[test]
fn a_1920x1080_request_copies_once_each_way_and_synchronises_once() {
    let _ = standin();
    let (mut stages, _engines) = engine_support::stages_on_engines(
        &engine_support::repo("onnx/u2netp"),
        GpuLimits::default(),
    );
    let image = photo();
    // The first request of a size uploads its resize tables (from pageable memory, while
    // the stream is idle); every later one of that size finds them in place.
    stages
        .run(&image, Planes::ALL, &mut StageTimings::default())
        .expect("the first request");

    let pixels = u64::from(W * H);
    let cutout = one_request(&mut stages, &image, Planes::CUTOUT);
    let alpha = one_request(&mut stages, &image, Planes::ALPHA);
    for (what, moved, down_bytes) in [("cut-out", &cutout, 4 * pixels), ("alpha", &alpha, pixels)] {
        assert_eq!(
            moved["htod_copies"], 1,
            "{what}: one upload, the RGB pixels"
        );
        assert_eq!(
            moved["htod_bytes"],
            3 * pixels,
            "{what}: the RGB pixels' bytes"
        );
        assert_eq!(moved["dtoh_copies"], 1, "{what}: one download");
        assert_eq!(
            moved["dtoh_bytes"], down_bytes,
            "{what}: the answer's bytes only"
        );
        // Every wait of the host: stream, event and context synchronisations, and copies
        // that return only once their stream ran them.
        assert_eq!(
            moved["host_syncs"], 1,
            "{what}: one host synchronisation: {moved:?}"
        );
        assert_eq!(
            moved["pinned_allocs"], 0,
            "{what}: nothing pinned on the request path"
        );
    }
    // The launches and memsets the design makes (docs/gpu.md lists them): any change is
    // a change to the request path, to be made here on purpose.
    assert_eq!(
        (cutout["launches_enqueued"], cutout["memsets"]),
        (LAUNCHES_CUTOUT, MEMSETS),
        "cut-out: launches and memsets"
    );
    assert_eq!(
        (alpha["launches_enqueued"], alpha["memsets"]),
        (LAUNCHES_ALPHA, MEMSETS),
        "alpha: launches and memsets"
    );
}

/// Kernel launches of one 1920x1080 request on U2NetP's pipeline.
const LAUNCHES_CUTOUT: u64 = 18;
const LAUNCHES_ALPHA: u64 = 18;
/// Device memsets of one request.
const MEMSETS: u64 = 1;
