//! `cuda_kernels --counts`: what one request asks of the CUDA driver, from celer's own
//! driver layer (`celer::cuda::driver::counters()`, before and after the request), so that
//! a real GPU, where the stand-in driver's counters do not exist, reports it too. Three
//! cut-outs through `GpuStages` on U2NetP: 1920x1080 repeated, 1920x1080 after a 1024x768
//! (the size's resize tables go up again), and 4032x3024 after a 1920x1080.
//!
//! Only celer's calls are counted, never TensorRT's own. The models run on ONNX Runtime
//! (on the CPU), so their input's download and output's upload are among the copies.

use std::sync::Arc;

use celer::codec::decode::{decode_into, DecodeLimits};
use celer::cuda::driver::{counters, DriverCounters};
use celer::cuda::{probe, GpuDevice, HostPool, Probe};
use celer::matte::{Planes, StageTimings};
use celer::pixels::RgbPixels;
use celer::replica::gpu::{host_pool, GpuLimits, GpuStages, ModelSource};
use celer::spec::PipelineSpec;
use image::{Rgb, RgbImage};
use serde_json::json;

/// A request counted: its name in the report, the size of the request run just before
/// it, and its own size.
struct Counted {
    name: &'static str,
    before: (u32, u32),
    size: (u32, u32),
}

const REQUESTS: [Counted; 3] = [
    Counted {
        name: "1920x1080 repeated",
        before: (1920, 1080),
        size: (1920, 1080),
    },
    Counted {
        name: "1920x1080 after 1024x768",
        before: (1024, 768),
        size: (1920, 1080),
    },
    Counted {
        name: "4032x3024 after 1920x1080",
        before: (1920, 1080),
        size: (4032, 3024),
    },
];

/// A counter of the report: its label and how it is read from a snapshot.
type Field = (&'static str, fn(&DriverCounters) -> u64);

/// The pool's blocks hold the largest size counted, as a server's do with
/// `--warmup-size 4032x3024`: every image is decoded into page-locked memory and no block
/// is pinned in the background while a request is counted.
const BLOCK_PIXELS: u64 = 4032 * 3024;

/// Counts each request of [`REQUESTS`] on GPU 0, prints them, and writes them as JSON to
/// `CELER_BENCH_JSON`.
pub fn run() -> Result<(), String> {
    let info = match probe() {
        Probe::Ready { gpus, .. } if !gpus.is_empty() => gpus[0].clone(),
        other => return Err(format!("no GPU: {}", other.summary())),
    };
    let device = GpuDevice::open(info.clone()).map_err(|e| format!("GPU 0: {e}"))?;
    let dir = repo("onnx/u2netp");
    let spec = PipelineSpec::load_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let limits = GpuLimits::default();
    let pool = host_pool(1, limits.max_pixels, BLOCK_PIXELS);
    pool.attach(device.context());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let mut stages = GpuStages::load(
        &spec,
        device,
        ModelSource::OnnxRuntime {
            intra_threads: threads,
        },
        limits,
        Arc::new(pool.clone()),
    )
    .map_err(|e| format!("U2NetP's GPU stages: {e}"))?;
    let mut rows = Vec::new();
    for request in &REQUESTS {
        cutout(&mut stages, &pool, request.before)?;
        rows.push((request, cutout(&mut stages, &pool, request.size)?));
    }
    print_table(stages.model_backend(), &rows);
    super::write_json(&json!({
        "gpu": info,
        "models": stages.model_backend(),
        "planes": "cut-out",
        "counted_by": "celer::cuda::driver::counters(): celer's own calls through its driver \
                       layer; TensorRT's own calls are not included",
        "requests": rows.iter().map(|(request, counts)| json!({
            "request": request.name,
            "size": [request.size.0, request.size.1],
            "after": [request.before.0, request.before.1],
            "counts": counts,
        })).collect::<Vec<_>>(),
    }));
    Ok(())
}

/// One cut-out of a `w` x `h` photo, decoded into `pool` as a server's decoder does; what
/// `GpuStages::run` asked of the driver.
fn cutout(
    stages: &mut GpuStages,
    pool: &HostPool,
    (w, h): (u32, u32),
) -> Result<DriverCounters, String> {
    let image = Arc::new(decoded(w, h, pool)?);
    let before = counters();
    stages
        .run(&image, Planes::CUTOUT, &mut StageTimings::default())
        .map_err(|e| format!("a {w}x{h} cut-out: {e}"))?;
    Ok(counters() - before)
}

/// A photo-like `w` x `h` JPEG (a subject on a background), decoded into `pool`.
fn decoded(w: u32, h: u32, pool: &HostPool) -> Result<RgbPixels, String> {
    let photo = RgbImage::from_fn(w, h, |x, y| {
        let inside = (w / 3..2 * w / 3).contains(&x) && (h / 5..4 * h / 5).contains(&y);
        let v: u32 = if inside { 210 } else { 40 };
        Rgb([v as u8, (v + x % 17) as u8, (v + y % 13) as u8])
    });
    let mut jpeg = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 90)
        .encode_image(&photo)
        .map_err(|e| format!("encoding a {w}x{h} JPEG: {e}"))?;
    decode_into(&jpeg, &DecodeLimits::default(), pool)
        .map_err(|e| format!("decoding a {w}x{h} JPEG: {e}"))
}

fn print_table(models: &str, rows: &[(&Counted, DriverCounters)]) {
    println!(
        "what one cut-out asks of the CUDA driver (celer::cuda::driver::counters(): celer's \
         own calls; TensorRT's own calls are not included; models on {models})"
    );
    print!("{:<24}", "");
    for (request, _) in rows {
        print!(" {:>26}", request.name);
    }
    println!();
    let fields: [Field; 13] = [
        ("HtoD copies", |c| c.htod_copies),
        ("HtoD bytes", |c| c.htod_bytes),
        ("DtoH copies", |c| c.dtoh_copies),
        ("DtoH bytes", |c| c.dtoh_bytes),
        ("DtoD copies", |c| c.dtod_copies),
        ("stream syncs", |c| c.stream_syncs),
        ("event syncs", |c| c.event_syncs),
        ("context syncs", |c| c.context_syncs),
        ("kernel launches", |c| c.launches),
        ("memsets", |c| c.memsets),
        ("host registrations", |c| c.host_registrations),
        ("pinned allocations", |c| c.pinned_allocs),
        ("pinned bytes", |c| c.pinned_alloc_bytes),
    ];
    for (label, field) in fields {
        print!("{label:<24}");
        for (_, counts) in rows {
            print!(" {:>26}", field(counts));
        }
        println!();
    }
}

/// A file of the repository: under `CELER_REPO_ROOT` in a packed check, else here.
fn repo(path: &str) -> std::path::PathBuf {
    std::env::var_os("CELER_REPO_ROOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join(path)
}
