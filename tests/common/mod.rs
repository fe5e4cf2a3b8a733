//! Helpers shared by the integration tests: where the fixtures, models and fetched test
//! images are, a served `AppState` built the way `celer serve` builds it, and small
//! generated images. Each test binary uses a different subset of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use celer::codec::decode::DecodeLimits;
use celer::config::RequestLimits;
use celer::http::{AppState, FrontEnd, UrlFetcher};
use celer::replica::cpu::cpu_device_setup;
use celer::sched::{Scheduler, SchedulerConfig};
use celer::spec::OutputKind;
use image::{ImageEncoder, Rgb, RgbImage};

/// `path` relative to the crate root.
pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The checkout's `.venv` Python (`make python`), which must import every one of
/// `modules`: a test that needs it fails, saying so, where it is missing.
pub fn venv_python(modules: &[&str]) -> PathBuf {
    let python = repo(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run `make python` (scripts/setup-python)",
        python.display()
    );
    if !modules.is_empty() {
        let imports = std::process::Command::new(&python)
            .args(["-c", &format!("import {}", modules.join(", "))])
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            imports,
            "{} cannot import {}: run `make python` (scripts/setup-python)",
            python.display(),
            modules.join(", ")
        );
    }
    python
}

/// What a finished process printed, stdout then stderr.
pub fn printed(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A fixture pipeline directory under `onnx/fixtures` (committed: always present).
pub fn fixture_dir(name: &str) -> PathBuf {
    let dir = repo("onnx/fixtures").join(name);
    assert!(
        dir.join("celer.toml").is_file(),
        "{} has no celer.toml",
        dir.display()
    );
    dir
}

/// A real model directory under `onnx` (e.g. `u2netp`); fails, saying how to get them,
/// when its model files have not been fetched.
pub fn model_dir(name: &str) -> PathBuf {
    let dir = repo("onnx").join(name);
    let spec = celer::spec::PipelineSpec::load_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for (key, model) in spec.model_keys() {
        assert!(
            model.is_file(),
            "{} (`{key}` of {}) is missing: run `make models`",
            model.display(),
            dir.display()
        );
    }
    dir
}

/// A fetched test image under `tests/data/fetched`; fails, saying how to get it, when
/// it has not been fetched.
pub fn fetched(name: &str) -> PathBuf {
    let path = repo("tests/data/fetched").join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `make models` (it fetches the test images too)",
        path.display()
    );
    path
}

/// What `celer serve` takes from its flags, with test-sized defaults.
pub struct StateOptions {
    pub replicas: usize,
    pub threads: usize,
    /// Threads of the sessions lent to a lone replica (`celer serve --solo-threads`);
    /// no more than `threads`: none.
    pub solo_threads: usize,
    pub queue_capacity: usize,
    pub limits: RequestLimits,
    /// `None`: the pipeline's own default.
    pub default_output: Option<OutputKind>,
    pub fetcher: Option<UrlFetcher>,
    pub server_timing: bool,
}

impl Default for StateOptions {
    fn default() -> Self {
        Self {
            replicas: 1,
            threads: 1,
            solo_threads: 0,
            queue_capacity: 16,
            limits: RequestLimits {
                max_body_bytes: 6 * 1024 * 1024,
                decode: DecodeLimits::default(),
                deadline: Duration::from_secs(60),
            },
            default_output: None,
            fetcher: None,
            server_timing: false,
        }
    }
}

/// The state `celer serve` builds for `model_dir`, with every replica loaded.
pub fn app_state(model_dir: &Path, options: StateOptions) -> AppState {
    let spec = celer::cli::load_pipeline(model_dir)
        .unwrap_or_else(|e| panic!("{}: {e:#}", model_dir.display()));
    let devices = vec![cpu_device_setup(
        &spec,
        options.replicas,
        options.threads,
        options.solo_threads,
        &[],
        celer::pixels::heap(),
    )];
    let router = Scheduler::start(
        devices,
        SchedulerConfig {
            queue_capacity: options.queue_capacity,
            ..Default::default()
        },
    );
    router
        .wait_ready()
        .unwrap_or_else(|e| panic!("{}: the replicas failed to load: {e}", model_dir.display()));
    AppState::new(
        router,
        FrontEnd {
            fetcher: options.fetcher,
            server_timing: options.server_timing,
            ..FrontEnd::new(
                options.limits,
                options.default_output.unwrap_or(spec.default_output),
            )
        },
    )
}

/// A `width` x `height` dark image (value 20) with a bright (235) rectangle covering
/// the middle half of each side: `[w/4, 3w/4) x [h/4, 3h/4)`.
pub fn bright_rectangle(width: u32, height: u32) -> RgbImage {
    RgbImage::from_fn(width, height, |x, y| {
        let inside =
            (width / 4..3 * width / 4).contains(&x) && (height / 4..3 * height / 4).contains(&y);
        if inside {
            Rgb([235, 235, 235])
        } else {
            Rgb([20, 20, 20])
        }
    })
}

/// A small `width` x `height` PNG of smooth gradients: a request body for tests about
/// the server rather than the pixels.
pub fn gradient_png(width: u32, height: u32) -> Vec<u8> {
    png_bytes(&RgbImage::from_fn(width, height, |x, y| {
        Rgb([(x * 4) as u8, (y * 5) as u8, 90])
    }))
}

pub fn png_bytes(image: &RgbImage) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(
            image.as_raw(),
            image.width(),
            image.height(),
            image::ExtendedColorType::Rgb8,
        )
        .expect("encoding a PNG");
    out
}

pub fn jpeg_bytes(image: &RgbImage, quality: u8) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality)
        .write_image(
            image.as_raw(),
            image.width(),
            image.height(),
            image::ExtendedColorType::Rgb8,
        )
        .expect("encoding a JPEG");
    out
}

/// What a stand-in device answers for `job` without a model: opaque alpha and trimap of
/// the image's size, no cut-out.
pub fn opaque_output(job: &celer::replica::MatteJob) -> celer::replica::MatteOutput {
    let (w, h) = job.image.dimensions();
    let matte = celer::matte::Matte::from_images(
        image::GrayImage::from_pixel(w, h, image::Luma([255])),
        image::GrayImage::from_pixel(w, h, image::Luma([255])),
    );
    celer::replica::MatteOutput {
        planes: celer::matte::MattePlanes::from_matte(matte, None),
        timings: job.timings,
    }
}
