//! Faults inside the server, injected into the real CPU pipeline (the `prob-guided`
//! fixture) by an executor that wraps it and misbehaves on images of a chosen width:
//!
//! - a panic in a stage answers that request 500 `internal_error` (JSON); the replica's
//!   executor is dropped and loaded afresh; the other requests go on;
//! - an ONNX Runtime error (a real one: the fixture's session asked for an input it does
//!   not have) is a 500 for that request only;
//! - a replica stuck past the request's deadline: the request gets 503
//!   `deadline_exceeded`, the stuck run is reported (`celer_replica_stuck_runs_total`,
//!   `celer_replicas_stuck`) and the device keeps serving on its other replica.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use celer::config::RequestLimits;
use celer::http::{routes, AppState, FrontEnd};
use celer::ort::session::OrtModel;
use celer::replica::cpu::{CpuExecutor, CpuStages};
use celer::replica::{BoxedMatteExecutor, MatteJob, MatteOutput};
use celer::sched::{DeviceSetup, ExecError, Executor, Scheduler, SchedulerConfig};
use celer::spec::PipelineSpec;
use common::{bright_rectangle, fixture_dir, png_bytes, StateOptions};
use http_body_util::BodyExt;
use tower::ServiceExt;

const PANIC_WIDTH: u32 = 13;
const ORT_ERROR_WIDTH: u32 = 17;
const STUCK_WIDTH: u32 = 19;
const STUCK_FOR: Duration = Duration::from_secs(3);

/// The real CPU executor, with faults on images of the widths above.
struct Faulty {
    inner: CpuExecutor,
    /// The fixture's own model, in a session of its own, for a real ONNX Runtime error.
    model: OrtModel,
}

impl Executor for Faulty {
    type Input = MatteJob;
    type Output = MatteOutput;

    fn run_batch(&mut self, jobs: &[&MatteJob]) -> Result<Vec<MatteOutput>, ExecError> {
        for job in jobs {
            match job.image.width() {
                PANIC_WIDTH => panic!("injected: a stage panicked"),
                ORT_ERROR_WIDTH => {
                    let data = vec![0.5f32; 3 * 8 * 8];
                    self.model
                        .run(&[("no_such_input", [1, 3, 8, 8], &data)], "mask")?;
                    return Err("the injected ONNX Runtime run unexpectedly succeeded".into());
                }
                STUCK_WIDTH => std::thread::sleep(STUCK_FOR),
                _ => {}
            }
        }
        self.inner.run_batch(jobs)
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        self.inner.health_check()
    }
}

struct Served {
    app: axum::Router,
    state: Arc<AppState>,
    loads: Arc<AtomicUsize>,
}

fn faulty_app(replicas: usize, deadline: Duration) -> Served {
    let dir = fixture_dir("prob-guided");
    let spec = PipelineSpec::load_dir(&dir).expect("the fixture's celer.toml");
    let loads = Arc::new(AtomicUsize::new(0));
    let load = {
        let (spec, loads) = (spec.clone(), loads.clone());
        Arc::new(move |_replica: usize| {
            loads.fetch_add(1, Ordering::SeqCst);
            let pipeline = CpuStages::load(&spec, 1)?;
            let model = OrtModel::load(&spec.segmentation.image.model, 1)?;
            Ok(Box::new(Faulty {
                inner: CpuExecutor::new(pipeline),
                model,
            }) as BoxedMatteExecutor)
        })
    };
    let router = Scheduler::start(
        vec![DeviceSetup {
            name: "cpu".into(),
            replicas,
            batching: spec.batching,
            load,
            interim: false,
        }],
        SchedulerConfig {
            health_check_interval: Duration::from_millis(200),
            ..SchedulerConfig::default()
        },
    );
    router.wait_ready().expect("replicas load");
    let defaults = StateOptions::default();
    let state = Arc::new(AppState::new(
        router,
        FrontEnd::new(
            RequestLimits {
                deadline,
                ..defaults.limits
            },
            spec.default_output,
        ),
    ));
    Served {
        app: routes(state.clone()),
        state,
        loads,
    }
}

struct Answer {
    status: StatusCode,
    json: Option<serde_json::Value>,
}

async fn post_image(app: &axum::Router, width: u32, height: u32) -> Answer {
    let request = Request::post("/invocations")
        .header(header::CONTENT_TYPE, "image/png")
        .body(Body::from(png_bytes(&bright_rectangle(width, height))))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v == "application/json");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        json: is_json.then(|| serde_json::from_slice(&body).expect("a JSON body")),
    }
}

fn assert_internal_error(answer: &Answer) {
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    let json = answer.json.as_ref().expect("a JSON refusal");
    assert_eq!(json["code"], "internal_error", "{json}");
    assert!(json["error"].as_str().is_some_and(|e| !e.is_empty()));
}

async fn metric(app: &axum::Router, name: &str) -> f64 {
    let response = app
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let text = String::from_utf8(
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panic_in_a_stage_is_a_500_and_the_replica_is_replaced() {
    let served = faulty_app(1, Duration::from_secs(60));
    let app = &served.app;
    assert_eq!(served.loads.load(Ordering::SeqCst), 1);

    assert_internal_error(&post_image(app, PANIC_WIDTH, 24).await);
    // The one replica serves again, with a fresh executor.
    assert_eq!(post_image(app, 64, 48).await.status, StatusCode::OK);
    assert_eq!(served.loads.load(Ordering::SeqCst), 2, "loaded afresh once");
    assert_eq!(metric(app, "celer_replica_replacements_total").await, 1.0);

    // Panics among normal requests: only the panicking ones fail.
    let requests: Vec<_> = (0..12)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let width = if i % 4 == 0 { PANIC_WIDTH } else { 64 };
                (width, post_image(&app, width, 48).await)
            })
        })
        .collect();
    for request in requests {
        let (width, answer) = request.await.unwrap();
        if width == PANIC_WIDTH {
            assert_internal_error(&answer);
        } else {
            assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.json);
        }
    }
    // A panicking request is answered before its replica reloads, so the last panic's
    // reload may still be under way; the one replica reloads before it takes another
    // job, so one more request makes the count certain.
    assert_eq!(post_image(app, 64, 48).await.status, StatusCode::OK);
    assert_eq!(served.loads.load(Ordering::SeqCst), 5);
    assert_eq!(
        served.state.scheduler.in_flight(),
        0,
        "every slot given back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_onnx_runtime_error_is_a_500_for_that_request_only() {
    let served = faulty_app(2, Duration::from_secs(60));
    let app = &served.app;
    assert_internal_error(&post_image(app, ORT_ERROR_WIDTH, 24).await);
    for _ in 0..3 {
        assert_eq!(post_image(app, 64, 48).await.status, StatusCode::OK);
    }
    // Errors and successes interleaved: the device never turns unhealthy (three errors
    // in a row would).
    for _ in 0..4 {
        assert_internal_error(&post_image(app, ORT_ERROR_WIDTH, 24).await);
        assert_eq!(post_image(app, 64, 48).await.status, StatusCode::OK);
    }
    assert!(served.state.scheduler.devices()[0].healthy);
    assert_eq!(
        served.loads.load(Ordering::SeqCst),
        2,
        "no replica replaced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stuck_replica_is_reported_and_routed_around() {
    let served = faulty_app(2, Duration::from_secs(1));
    let app = &served.app;
    let stuck = {
        let app = app.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            (post_image(&app, STUCK_WIDTH, 24).await, started.elapsed())
        })
    };
    // While one replica is stuck, the other serves every request.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(2000) {
        let answer = post_image(app, 64, 48).await;
        assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.json);
    }
    let (answer, took) = stuck.await.unwrap();
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        answer.json.as_ref().unwrap()["code"],
        "deadline_exceeded",
        "{:?}",
        answer.json
    );
    assert!(
        took < STUCK_FOR - Duration::from_millis(500),
        "answered at its deadline, not after the run: {took:?}"
    );
    // Reported, and the device still healthy: it has a working replica.
    assert_eq!(metric(app, "celer_replica_stuck_runs_total").await, 1.0);
    assert_eq!(metric(app, "celer_replicas_stuck").await, 1.0);
    assert!(served.state.scheduler.devices()[0].healthy);
    // When the run ends, the replica counts again.
    let ended = Instant::now();
    while metric(app, "celer_replicas_stuck").await != 0.0 {
        assert!(ended.elapsed() < STUCK_FOR * 2, "the stuck run never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = post_image(app, 64, 48).await;
    assert_eq!(last.status, StatusCode::OK, "{:?}", last.json);
}
