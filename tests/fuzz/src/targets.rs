//! The bodies of celer's fuzz targets. Each takes arbitrary bytes, drives one entry point
//! of celer with them, and panics (a crash, to libFuzzer) only when an invariant breaks:
//! nothing here may panic on its own, and neither may celer.
//!
//! - `decode`: `codec::decode::decode` under small limits, and `jpeg_ends_early`;
//! - `request`: a whole HTTP request (method, path, headers, body) through the real
//!   routes, negotiation, body parsing (raw image, JSON, base64), decoding and rendering,
//!   with a stand-in executor in place of the models;
//! - `celer_toml`: `PipelineSpec::parse`;
//! - `manifest`: `EngineManifest::parse`, its checks, and a serialisation round trip.
//!
//! Compiled by the cargo-fuzz crate (tests/fuzz) and by tests/fuzz_corpus.rs, which
//! replays the committed corpus on stable as part of `make test`.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use celer::codec::decode::{self, DecodeLimits};
use celer::config::RequestLimits;
use celer::engines::manifest::{EngineManifest, EngineRequirements, GpuIdentity};
use celer::http::{routes, AppState, FrontEnd};
use celer::matte::{Matte, MattePlanes};
use celer::replica::{BoxedMatteExecutor, MatteJob, MatteOutput};
use celer::sched::{DeviceSetup, ExecError, Executor, Scheduler, SchedulerConfig};
use celer::spec::BatchingSpec;
use celer::spec::{OutputKind, PipelineSpec};
use celer::tensorrt::TrtVersion;
use http_body_util::BodyExt;
use image::{GrayImage, Luma, Rgba, RgbaImage};
use tower::ServiceExt;

/// Small enough that each input decodes in milliseconds.
const LIMITS: DecodeLimits = DecodeLimits {
    max_pixels: 1 << 20,
    min_side_px: 1,
    max_side_px: 2048,
};

pub fn decode(data: &[u8]) {
    let _ = decode::jpeg_ends_early(data);
    if let Ok(image) = decode::decode(data, &LIMITS) {
        let (w, h) = image.dimensions();
        assert!(w >= LIMITS.min_side_px && h >= LIMITS.min_side_px);
        assert!(w.max(h) <= LIMITS.max_side_px);
        assert!(u64::from(w) * u64::from(h) <= LIMITS.max_pixels);
        assert_eq!(image.as_raw().len(), w as usize * h as usize * 3);
    }
}

/// Opaque alpha, the cut-out when asked: what a device returns, without a model.
struct Standin;

impl Executor for Standin {
    type Input = MatteJob;
    type Output = MatteOutput;

    fn run_batch(&mut self, jobs: &[&MatteJob]) -> Result<Vec<MatteOutput>, ExecError> {
        Ok(jobs
            .iter()
            .map(|job| {
                let (w, h) = job.image.dimensions();
                let matte = Matte::from_images(
                    GrayImage::from_pixel(w, h, Luma([255])),
                    GrayImage::from_pixel(w, h, Luma([128])),
                );
                let cutout = job
                    .planes
                    .cutout
                    .then(|| RgbaImage::from_pixel(w, h, Rgba([1, 2, 3, 255])));
                MatteOutput {
                    planes: MattePlanes::from_matte(matte, cutout),
                    timings: job.timings,
                }
            })
            .collect())
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
}

struct Served {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
}

fn served() -> &'static Served {
    static SERVED: OnceLock<Served> = OnceLock::new();
    SERVED.get_or_init(|| {
        let load = Arc::new(|_replica: usize| Ok(Box::new(Standin) as BoxedMatteExecutor));
        let router = Scheduler::start(
            vec![DeviceSetup {
                name: "standin".into(),
                replicas: 1,
                batching: BatchingSpec::OFF,
                load,
                interim: false,
            }],
            SchedulerConfig::default(),
        );
        let limits = RequestLimits {
            max_body_bytes: 256 * 1024,
            decode: LIMITS,
            deadline: Duration::from_secs(30),
        };
        let state = AppState::new(router, FrontEnd::new(limits, OutputKind::Cutout));
        Served {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime"),
            app: routes(Arc::new(state)),
        }
    })
}

/// The request an input describes: byte 0 picks the method and the path; then header
/// lines `name: value` up to an empty line; the rest is the body.
fn request_of(data: &[u8]) -> Option<Request<Body>> {
    let (&selector, rest) = data.split_first()?;
    let method = match selector & 3 {
        0 | 1 => Method::POST,
        2 => Method::GET,
        _ => Method::PUT,
    };
    let path = match (selector >> 2) & 3 {
        0 | 1 => "/invocations",
        2 => "/ping",
        _ => "/metrics",
    };
    let split = rest.windows(2).position(|w| w == b"\n\n");
    let (head, body) = match split {
        Some(at) => (&rest[..at], &rest[at + 2..]),
        None => (&rest[..0], rest),
    };
    let mut builder = Request::builder().method(method).uri(path);
    for line in head.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let name = HeaderName::from_bytes(line[..colon].trim_ascii());
        let value = HeaderValue::from_bytes(line[colon + 1..].trim_ascii());
        if let (Ok(name), Ok(value)) = (name, value) {
            builder = builder.header(name, value);
        }
    }
    builder.body(Body::from(body.to_vec())).ok()
}

pub fn request(data: &[u8]) {
    let Some(request) = request_of(data) else {
        return;
    };
    let served = served();
    let (status, content_type, body) = served.runtime.block_on(async {
        let response = served
            .app
            .clone()
            .oneshot(request)
            .await
            .expect("infallible");
        let status = response.status();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("a response body")
            .to_bytes();
        (status, content_type, body)
    });
    // The stand-in never fails: a 500 is a bug of the request path.
    assert_ne!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{:?}",
        String::from_utf8_lossy(&body)
    );
    if status.is_success() {
        assert!(
            [
                "image/png",
                "application/json",
                "application/openmetrics-text"
            ]
            .iter()
            .any(|t| content_type.starts_with(t)),
            "{content_type}"
        );
    } else {
        assert_eq!(content_type, "application/json", "{status}");
        let json: serde_json::Value = serde_json::from_slice(&body).expect("a JSON refusal");
        assert!(json["code"].is_string(), "{json}");
        assert!(json["error"].is_string(), "{json}");
    }
}

pub fn celer_toml(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(spec) = PipelineSpec::parse(&text, Path::new("fuzz/celer.toml")) {
        // Every model the description names resolves to a path (against the file's
        // folder, or as given when absolute).
        for (key, model) in spec.model_keys() {
            assert!(!key.is_empty());
            assert!(!model.as_os_str().is_empty());
        }
    }
}

pub fn manifest(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(manifest) = EngineManifest::parse(text) else {
        return;
    };
    let have = EngineRequirements {
        gpu: GpuIdentity {
            name: "NVIDIA H200".into(),
            compute_capability: "9.0".into(),
        },
        tensorrt_version: TrtVersion {
            major: 10,
            minor: 13,
            patch: 0,
        },
        onnx_sha256: "0".repeat(64),
    };
    let reasons = manifest.mismatches(&have);
    let checked = manifest.check(Path::new("plan"), &have, Path::new("model"));
    assert_eq!(reasons.is_empty(), checked.is_ok());
    let again = serde_json::to_string(&manifest).expect("a manifest serialises");
    assert_eq!(
        EngineManifest::parse(&again).expect("and parses back"),
        manifest
    );
}
