//! The router behind the HTTP front end: `/ping` answers while every queue is full, a
//! full server answers 503 with Retry-After and a JSON body at once, `/metrics` shows the
//! figures; and the real pipeline (a fixture on the CPU, batched) served through the
//! router.

mod common;
mod sched_support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use celer::codec::decode::DecodeLimits;
use celer::config::RequestLimits;
use celer::http::{routes, AppState, FrontEnd};
use celer::replica::cpu::cpu_device_setup;
use celer::replica::{BoxedMatteExecutor, MatteJob, MatteOutput};
use celer::sched::{DeviceSetup, ExecError, Executor, Scheduler, SchedulerConfig};
use celer::spec::{BatchingSpec, OutputKind, PipelineSpec};
use http_body_util::BodyExt;
use image::{Rgb, RgbImage};
use sched_support::{Gate, PATIENCE};
use tower::ServiceExt;

/// The device stages as a gate: answers an opaque matte once let through.
struct GatedPipeline(Arc<Gate>);

impl Executor for GatedPipeline {
    type Input = MatteJob;
    type Output = MatteOutput;

    fn run_batch(&mut self, inputs: &[&MatteJob]) -> Result<Vec<MatteOutput>, ExecError> {
        self.0.pass(vec![inputs.len() as u32])?;
        Ok(inputs
            .iter()
            .map(|job| common::opaque_output(job))
            .collect())
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
}

fn limits() -> RequestLimits {
    RequestLimits {
        max_body_bytes: 1 << 20,
        decode: DecodeLimits::default(),
        deadline: Duration::from_secs(60),
    }
}

/// The HTTP state over `router`, answering alpha PNGs by default.
fn alpha_server(router: Scheduler<BoxedMatteExecutor>) -> Arc<AppState> {
    Arc::new(AppState::new(
        router,
        FrontEnd::new(limits(), OutputKind::Alpha),
    ))
}

fn png(width: u32, height: u32) -> Vec<u8> {
    let image = RgbImage::from_fn(width, height, |x, y| {
        if (width / 4..3 * width / 4).contains(&x) && (height / 4..3 * height / 4).contains(&y) {
            Rgb([235, 235, 235])
        } else {
            Rgb([20, 20, 20])
        }
    });
    let mut out = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut out, image::ImageFormat::Png)
        .expect("encode png");
    out.into_inner()
}

fn invocation(body: Vec<u8>) -> Request<Body> {
    Request::post("/invocations")
        .header(header::CONTENT_TYPE, "image/png")
        .body(Body::from(body))
        .expect("request")
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).expect("request")
}

async fn text(response: axum::response::Response) -> String {
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn metrics(app: &axum::Router) -> String {
    let response = app.clone().oneshot(get("/metrics")).await.expect("answer");
    assert_eq!(response.status(), StatusCode::OK);
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    // Prometheus' text format 0.0.4, as Triton serves it (not OpenMetrics, which would
    // rename Triton's counters with `_total`).
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    text(response).await
}

fn assert_has(metrics: &str, line: &str) {
    assert!(
        metrics.lines().any(|l| l == line),
        "no line `{line}` in /metrics:\n{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_answers_and_overload_is_a_503_while_every_queue_is_full() {
    let gate = Gate::closed();
    let held = gate.clone();
    let device: DeviceSetup<BoxedMatteExecutor> = DeviceSetup {
        name: "gated".into(),
        replicas: 1,
        batching: BatchingSpec::OFF,
        load: Arc::new(move |_| Ok(Box::new(GatedPipeline(held.clone())) as BoxedMatteExecutor)),
        interim: false,
    };
    let scheduler = Scheduler::start(
        vec![device],
        SchedulerConfig {
            queue_capacity: 2,
            ..SchedulerConfig::default()
        },
    );
    scheduler.wait_ready().expect("ready");
    let state = alpha_server(scheduler);
    let app = routes(state.clone());
    let image = png(48, 32);

    // One running, two queued: the server is full. The first is sent alone, so that
    // the other two find its queue slot free again.
    let mut clients = vec![tokio::spawn(app.clone().oneshot(invocation(image.clone())))];
    let entered = gate.clone();
    tokio::task::spawn_blocking(move || entered.wait_entered(1))
        .await
        .expect("the first request runs");
    for _ in 0..2 {
        clients.push(tokio::spawn(app.clone().oneshot(invocation(image.clone()))));
    }
    let deadline = Instant::now() + PATIENCE;
    while state.scheduler.in_flight() < 3 || state.scheduler.devices()[0].queued < 2 {
        assert!(
            Instant::now() < deadline,
            "the requests never filled the queue"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    let ping = app.clone().oneshot(get("/ping")).await.expect("answer");
    assert_eq!(ping.status(), StatusCode::OK);

    let refused = app
        .clone()
        .oneshot(invocation(image.clone()))
        .await
        .expect("answer");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let body: serde_json::Value = serde_json::from_str(&text(refused).await).expect("a JSON body");
    assert_eq!(body["code"], "overloaded");

    let full = metrics(&app).await;
    assert_has(
        &full,
        r#"celer_inference_request_rejected_total{reason="overloaded"} 1"#,
    );
    assert_has(
        &full,
        r#"celer_inference_pending_request_count{device="gated"} 2"#,
    );
    assert_has(&full, r#"celer_inference_exec_in_flight{device="gated"} 1"#);
    assert_has(&full, r#"celer_device_healthy{device="gated"} 1"#);
    assert_has(&full, r#"celer_device_replicas{device="gated"} 1"#);
    assert_has(
        &full,
        r#"celer_http_requests_total{path="/invocations",status="503",outcome="rejected"} 1"#,
    );
    assert_has(
        &full,
        r#"celer_http_requests_total{path="/ping",status="200",outcome="success"} 1"#,
    );
    assert_has(&full, "# TYPE celer_http_requests_total counter");
    // Triton's families, under its names and labels; the signals to scale on: every
    // place taken (one running, two queued of 1 + 2).
    assert_has(
        &full,
        r#"nv_inference_request_failure{model="celer",reason="REJECTED",version="1"} 1"#,
    );
    assert_has(
        &full,
        r#"nv_inference_pending_request_count{model="celer",version="1"} 2"#,
    );
    assert_has(&full, "celer_capacity_in_use_ratio 1");
    assert_has(
        &full,
        r#"celer_device_capacity_in_use_ratio{device="gated"} 1"#,
    );

    gate.set_open(true);
    for client in clients {
        let response = client.await.expect("client task").expect("answer");
        assert_eq!(response.status(), StatusCode::OK);
    }
    let after = metrics(&app).await;
    assert_has(
        &after,
        r#"celer_inference_request_success_total{device="gated"} 3"#,
    );
    assert_has(
        &after,
        r#"celer_inference_queue_duration_us_count{device="gated"} 3"#,
    );
    assert_has(
        &after,
        r#"celer_inference_compute_infer_duration_us_count{device="gated"} 3"#,
    );
    assert_has(
        &after,
        r#"celer_inference_batch_size_count{device="gated"} 3"#,
    );
    assert_has(
        &after,
        r#"celer_inference_stage_duration_us_count{stage="decode"} 3"#,
    );
    assert_has(
        &after,
        r#"celer_http_requests_total{path="/invocations",status="200",outcome="success"} 3"#,
    );
    for family in [
        "nv_inference_request_success",
        "nv_inference_count",
        "nv_inference_exec_count",
    ] {
        assert_has(
            &after,
            &format!(r#"{family}{{model="celer",version="1"}} 3"#),
        );
        assert_has(&after, &format!("# TYPE {family} counter"));
    }
    assert_has(&after, "# TYPE nv_inference_request_duration_us counter");
    assert_has(
        &after,
        r#"nv_inference_pending_request_count{model="celer",version="1"} 0"#,
    );
    assert_has(&after, "celer_capacity_in_use_ratio 0");
    state.scheduler.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cpu_pipeline_is_served_through_the_router_in_replicas() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/fixtures/prob-guided");
    let mut spec = PipelineSpec::load_dir(&dir).expect("fixture description");
    // The fixture's batch dimension is dynamic: batching is allowed.
    spec.batching = BatchingSpec {
        max_batch: 4,
        max_wait_us: 1_000,
    };
    let devices = vec![cpu_device_setup(&spec, 2, 1, 0, &[], celer::pixels::heap())];
    let scheduler = Scheduler::start(devices, SchedulerConfig::default());
    let loaded = tokio::task::block_in_place(|| scheduler.wait_ready());
    loaded.expect("the fixture loads (ONNX Runtime from .venv or ORT_DYLIB_PATH)");
    let state = Arc::new(AppState::new(
        scheduler,
        FrontEnd::new(limits(), OutputKind::Cutout),
    ));
    let app = routes(state.clone());

    let answers: Vec<_> = (0..6)
        .map(|_| tokio::spawn(app.clone().oneshot(invocation(png(96, 64)))))
        .collect();
    for answer in answers {
        let response = answer.await.expect("client task").expect("answer");
        assert_eq!(response.status(), StatusCode::OK);
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let cutout = image::load_from_memory(&body).expect("a PNG").into_rgba8();
        assert_eq!(cutout.dimensions(), (96, 64));
        // Bright middle kept, dark border cut away.
        assert!(cutout.get_pixel(48, 32)[3] > 200);
        assert!(cutout.get_pixel(2, 2)[3] < 50);
    }
    let figures = metrics(&app).await;
    assert_has(
        &figures,
        r#"celer_inference_request_success_total{device="cpu"} 6"#,
    );
    assert_has(&figures, r#"celer_device_replicas{device="cpu"} 2"#);
    assert_has(
        &figures,
        r#"celer_inference_stage_duration_us_count{stage="model"} 6"#,
    );
    state.scheduler.shutdown();
}

/// A device still loading (a GPU building its engines at start-up takes minutes) keeps
/// `/ping` at 503 "loading"; once the load finishes, `/ping` is 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_is_503_until_every_replica_has_loaded() {
    let (finish_loading, loading) = std::sync::mpsc::channel::<()>();
    let loading = std::sync::Mutex::new(loading);
    let gate = Gate::closed();
    let device: DeviceSetup<BoxedMatteExecutor> = DeviceSetup {
        name: "slow-to-load".into(),
        replicas: 1,
        batching: BatchingSpec::OFF,
        load: Arc::new(move |_| {
            // Stands for an engine build: returns when the test says so.
            let _ = loading.lock().map(|rx| rx.recv());
            Ok(Box::new(GatedPipeline(gate.clone())) as BoxedMatteExecutor)
        }),
        interim: false,
    };
    let scheduler = Scheduler::start(vec![device], SchedulerConfig::default());
    let state = alpha_server(scheduler);
    let app = routes(state.clone());

    let ping = app.clone().oneshot(get("/ping")).await.expect("answer");
    assert_eq!(ping.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = text(ping).await;
    assert!(body.contains(r#""status":"loading""#), "{body}");
    assert!(body.contains(r#""replicas":1"#), "{body}");

    finish_loading.send(()).expect("the loader waits");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let ping = app.clone().oneshot(get("/ping")).await.expect("answer");
        if ping.status() == StatusCode::OK {
            break;
        }
        assert_eq!(ping.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(Instant::now() < deadline, "/ping never became 200");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    state.scheduler.shutdown();
}

/// One gRPC call over HTTP/2 (prior knowledge, as gRPC's clients speak it): the gRPC
/// status in the answer's head (a refusal is trailers-only), or `None` with the message
/// when answered (its status then is in the trailers).
async fn grpc_call(
    client: &reqwest::Client,
    url: String,
    body: bytes::Bytes,
) -> (Option<String>, bytes::Bytes) {
    let response = client
        .post(url)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    let status = response
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_string());
    (status, response.bytes().await.unwrap())
}

/// While the replicas load (an engine build at start-up), gRPC's ModelInfer is refused
/// at once with UNAVAILABLE (14) and gRPC health says NOT_SERVING (2); once loaded, the
/// same call is answered and health says SERVING (1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_is_unavailable_until_every_replica_has_loaded() {
    let (finish_loading, loading) = std::sync::mpsc::channel::<()>();
    let loading = std::sync::Mutex::new(loading);
    let gate = Gate::open();
    let device: DeviceSetup<BoxedMatteExecutor> = DeviceSetup {
        name: "slow-to-load".into(),
        replicas: 1,
        batching: BatchingSpec::OFF,
        load: Arc::new(move |_| {
            let _ = loading.lock().map(|rx| rx.recv());
            Ok(Box::new(GatedPipeline(gate.clone())) as BoxedMatteExecutor)
        }),
        interim: false,
    };
    let state = alpha_server(Scheduler::start(vec![device], SchedulerConfig::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let limits = celer::http::grpc::GrpcLimits::from_rest(
        &celer::config::ConnLimits::default(),
        &state.limits,
        state.scheduler.admission_limit(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(celer::http::grpc::serve(
        listener,
        state.clone(),
        limits,
        async {
            let _ = stopped.await;
        },
    ));
    let client = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let infer = || {
        let body =
            celer::bench::http::Payload::grpc_infer(&png(64, 48), "alpha", "celer", None).body;
        grpc_call(
            &client,
            format!("http://{address}/inference.GRPCInferenceService/ModelInfer"),
            body,
        )
    };
    // An empty HealthCheckRequest (service ""), framed: no compression, length 0.
    let health = || {
        grpc_call(
            &client,
            format!("http://{address}/grpc.health.v1.Health/Check"),
            bytes::Bytes::from_static(&[0, 0, 0, 0, 0]),
        )
    };
    let (status, _) = infer().await;
    assert_eq!(status.as_deref(), Some("14"), "UNAVAILABLE while loading");
    let (status, message) = health().await;
    assert_eq!(status, None);
    assert_eq!(&message[..], &[0, 0, 0, 0, 2, 0x08, 0x02], "NOT_SERVING");

    finish_loading.send(()).expect("the loader waits");
    state.scheduler.wait_ready().expect("loads");
    let (status, message) = infer().await;
    assert_eq!(status, None, "answered once loaded");
    assert!(message.len() > 5 + 64 * 48, "{} bytes", message.len());
    let (_, message) = health().await;
    assert_eq!(&message[..], &[0, 0, 0, 0, 2, 0x08, 0x01], "SERVING");

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    state.scheduler.shutdown();
}
