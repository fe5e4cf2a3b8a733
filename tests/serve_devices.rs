//! Which devices `celer serve` and `celer run` start, as far as a machine without a GPU
//! can show it: a named GPU that is not there stops the start with the probe's word; a
//! GPU whose TensorRT is absent is planned onto ONNX Runtime with the reason; a GPU
//! device whose load fails is reported by the router as a failed load, not a panic. The
//! CUDA driver is hidden (CELER_LIBCUDA_PATH points nowhere), so these mean the same on
//! a GPU machine; the GPU itself is exercised by tests/cuda_gpu.rs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use celer::cuda::GpuInfo;
use celer::engines::dirs::EngineDirs;
use celer::engines::plan::plan_gpus;
use celer::engines::select::GpuModels;
use celer::replica::gpu::{gpu_device_setup, GpuLimits};
use celer::sched::{Readiness, Scheduler, SchedulerConfig};

const HIDE_DRIVER: (&str, &str) = ("CELER_LIBCUDA_PATH", "/nonexistent/libcuda.so.1");

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// An H200 as the probe would describe it; nothing here opens it.
fn h200() -> GpuInfo {
    GpuInfo {
        ordinal: 0,
        name: "NVIDIA H200".into(),
        compute_capability: (9, 0),
        total_memory_bytes: 141 << 30,
        uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
        memory_clock_khz: 3_201_000,
        memory_bus_width_bits: 6144,
        multiprocessors: 132,
    }
}

/// The model folder's own engines/, as `serve` uses it without --engines-dir.
fn shipped(model_dir: &Path) -> EngineDirs {
    EngineDirs::resolve(model_dir, None, false).expect("no folder is written without builds")
}

fn celer(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_celer"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(HIDE_DRIVER.0, HIDE_DRIVER.1)
        .env("CELER_LOG", "warn")
        .output()
        .expect("the celer binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `celer run` on U2NetP's folder and `devices`, writing into `out`; `rest`: more options,
/// then the images.
fn celer_run(devices: &str, out: &Path, rest: &[&str]) -> (bool, String) {
    let out = out.to_str().expect("a UTF-8 temporary folder");
    let mut args = vec![
        "run",
        "--model-dir",
        "onnx/u2netp",
        "--devices",
        devices,
        "-o",
        out,
    ];
    args.extend_from_slice(rest);
    celer(&args)
}

#[test]
fn serve_on_a_gpu_that_is_not_there_stops_before_listening() {
    let (ok, text) = celer(&[
        "serve",
        "--model-dir",
        "onnx/u2netp",
        "--devices",
        "0",
        "--port",
        "0",
    ]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("GPU 0 not found (the probe found none)"),
        "{text}"
    );
    assert!(text.contains("no CUDA driver"), "{text}");
    assert!(text.contains("--devices cpu or auto"), "{text}");
}

#[test]
fn run_on_a_gpu_that_is_not_there_says_so() {
    let out = tempfile::tempdir().unwrap();
    let (ok, text) = celer_run("1", out.path(), &["tests/data/fetched/photo-320x320.jpg"]);
    assert!(!ok, "{text}");
    assert!(text.contains("GPU 1 not found"), "{text}");
}

/// `celer run` over images of both sizes the server sees (each priced by its pixels): every
/// image is matted and written at its own size, small ones queued among 12 MP ones.
#[test]
fn run_mattes_images_of_mixed_sizes_each_at_its_own_size() {
    let out = tempfile::tempdir().unwrap();
    let (ok, text) = celer_run(
        "cpu",
        out.path(),
        &[
            "--output",
            "alpha",
            "tests/data/fetched/photo-320x320.jpg",
            "tests/data/fetched/photo-4032x3024.jpg",
            "tests/data/fetched/photo-1920x1080.jpg",
        ],
    );
    assert!(ok, "{text}");
    assert!(text.contains("3 images done, 0 failed"), "{text}");
    for (stem, size) in [
        ("photo-320x320", (320, 320)),
        ("photo-4032x3024", (4032, 3024)),
        ("photo-1920x1080", (1920, 1080)),
    ] {
        let alpha = image::open(out.path().join(format!("{stem}.png")))
            .unwrap_or_else(|e| panic!("{stem}.png: {e}"))
            .into_luma8();
        assert_eq!(alpha.dimensions(), size, "{stem}");
        // A matte, not a blank plane: the photos each hold a subject on a background.
        let (lo, hi) = alpha
            .pixels()
            .fold((u8::MAX, 0), |(lo, hi), p| (lo.min(p[0]), hi.max(p[0])));
        assert!(lo < 16 && hi > 240, "{stem}: alpha spans {lo}..={hi}");
    }
}

#[test]
fn without_tensorrt_a_gpu_is_planned_onto_onnx_runtime_with_the_reason() {
    let dir = repo("onnx/u2netp");
    let spec = celer::cli::load_pipeline(&dir).unwrap();
    let plans = plan_gpus(
        &spec,
        &dir,
        &shipped(&dir),
        &[h200()],
        false,
        Some("13.0".into()),
    )
    .expect("no engine is needed where TensorRT is absent");
    assert_eq!(plans.len(), 1);
    match &plans[0].models {
        GpuModels::OnnxRuntime { reason } => {
            // Default build: no TensorRT compiled in; with the feature: no library here.
            assert!(
                reason.contains("built without TensorRT") || reason.contains("TensorRT library"),
                "{reason}"
            );
        }
        other => panic!("expected ONNX Runtime on this machine, got {other:?}"),
    }
}

#[test]
fn a_gpu_device_that_cannot_open_fails_its_load_and_the_router_says_why() {
    std::env::set_var(HIDE_DRIVER.0, HIDE_DRIVER.1);
    let dir = repo("onnx/u2netp");
    let spec = celer::cli::load_pipeline(&dir).unwrap();
    let plan = plan_gpus(&spec, &dir, &shipped(&dir), &[h200()], false, None)
        .unwrap()
        .pop()
        .unwrap();
    let pool = celer::replica::gpu::host_pool(2, 1 << 20, 1 << 20);
    let serving = celer::replica::gpu::GpuServing::new(GpuLimits::default(), pool);
    let setup = gpu_device_setup(&spec, plan, 2, 1, serving);
    assert_eq!(setup.name, "gpu0");
    assert_eq!(setup.replicas, 2);
    let router = Scheduler::start(vec![setup], SchedulerConfig::default());
    let started = std::time::Instant::now();
    let reason = loop {
        match router.readiness() {
            Readiness::Failed(reason) => break reason,
            Readiness::Ready | Readiness::Interim { .. } => {
                panic!("a GPU without a driver cannot be ready")
            }
            Readiness::Loading { .. } => {
                assert!(started.elapsed() < Duration::from_secs(60), "still loading");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    assert!(reason.contains("gpu0 (NVIDIA H200)"), "{reason}");
    assert!(reason.contains("no CUDA driver"), "{reason}");
    router.shutdown();
}
