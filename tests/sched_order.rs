//! The order a device runs its queue in and the requests it refuses for their deadline,
//! as clients ask over HTTP: `priority=` and `deadline-ms=` in SageMaker's custom
//! attributes, `priority` and `timeout` (microseconds) in the v2 parameters. A gated
//! device holds its first run while the others queue, so the order the gate records is
//! the queue's order, whatever the timing.

mod common;
mod sched_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use base64::Engine as _;
use celer::codec::decode::DecodeLimits;
use celer::config::RequestLimits;
use celer::http::{routes, AppState, FrontEnd};
use celer::replica::{BoxedMatteExecutor, MatteJob, MatteOutput};
use celer::sched::{
    DeviceSetup, ExecError, Executor, RunParts, Scheduler, SchedulerConfig, Scheduling,
};
use celer::spec::{BatchingSpec, OutputKind};
use http_body_util::BodyExt;
use sched_support::{Gate, PATIENCE};
use tower::ServiceExt;

/// The device's stages as a gate that records each run's image width.
struct GatedByWidth(Arc<Gate>);

impl Executor for GatedByWidth {
    type Input = MatteJob;
    type Output = MatteOutput;

    fn run_batch(&mut self, inputs: &[&MatteJob]) -> Result<Vec<MatteOutput>, ExecError> {
        self.0
            .pass(inputs.iter().map(|job| job.image.dimensions().0).collect())?;
        Ok(inputs
            .iter()
            .map(|job| common::opaque_output(job))
            .collect())
    }

    /// No fixed part: what the gate held the run for is put on its pixels.
    fn parts(&self, _output: &MatteOutput) -> Option<RunParts> {
        Some(RunParts {
            fixed: Duration::ZERO,
            composite: Duration::ZERO,
        })
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
}

struct Served {
    gate: Arc<Gate>,
    state: Arc<AppState>,
    app: axum::Router,
}

fn serve(scheduling: Scheduling) -> Served {
    let gate = Gate::closed();
    let held = gate.clone();
    let device: DeviceSetup<BoxedMatteExecutor> = DeviceSetup {
        name: "gated".into(),
        replicas: 1,
        batching: BatchingSpec::OFF,
        load: Arc::new(move |_| Ok(Box::new(GatedByWidth(held.clone())) as BoxedMatteExecutor)),
        interim: false,
    };
    let scheduler = Scheduler::start(
        vec![device],
        SchedulerConfig {
            queue_capacity: 8,
            scheduling,
            ..SchedulerConfig::default()
        },
    );
    scheduler.wait_ready().expect("ready");
    let limits = RequestLimits {
        max_body_bytes: 1 << 24,
        decode: DecodeLimits::default(),
        deadline: Duration::from_secs(60),
    };
    let state = Arc::new(AppState::new(
        scheduler,
        FrontEnd::new(limits, OutputKind::Alpha),
    ));
    let app = routes(state.clone());
    Served { gate, state, app }
}

fn png(width: u32, height: u32) -> Vec<u8> {
    common::png_bytes(&common::bright_rectangle(width, height))
}

fn invocation(width: u32, height: u32, attributes: &str) -> Request<Body> {
    let mut request = Request::post("/invocations").header(header::CONTENT_TYPE, "image/png");
    if !attributes.is_empty() {
        request = request.header("X-Amzn-SageMaker-Custom-Attributes", attributes);
    }
    request
        .body(Body::from(png(width, height)))
        .expect("request")
}

fn v2_infer(width: u32, height: u32, parameters: serde_json::Value) -> Request<Body> {
    let b64 = base64::engine::general_purpose::STANDARD.encode(png(width, height));
    let body = serde_json::json!({
        "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [b64]}],
        "outputs": [{"name": "alpha"}],
        "parameters": parameters,
    });
    Request::post("/v2/models/celer/infer")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("request")
}

async fn json(response: axum::response::Response) -> serde_json::Value {
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| serde_json::json!({"raw": String::from_utf8_lossy(&bytes)}))
}

/// The answer's error is `deadline_unreachable`: SageMaker's `code`, or in the v2
/// error's text.
async fn assert_refused_for_its_deadline(refused: axum::response::Response) {
    let body = json(refused).await;
    let code = body["code"]
        .as_str()
        .or(body["error"].as_str())
        .unwrap_or_default();
    assert!(code.contains("deadline_unreachable"), "{body}");
}

impl Served {
    /// Sends `request` and waits for its answer.
    async fn ask(&self, request: Request<Body>) -> axum::response::Response {
        self.app.clone().oneshot(request).await.expect("answer")
    }

    /// Sends `request` without waiting for its answer.
    fn send(&self, request: Request<Body>) -> tokio::task::JoinHandle<axum::response::Response> {
        let app = self.app.clone();
        tokio::spawn(async move { app.oneshot(request).await.expect("answer") })
    }

    /// Waits until `n` requests are queued behind the held run.
    async fn until_queued(&self, n: usize) {
        let deadline = Instant::now() + PATIENCE;
        while self.state.scheduler.devices()[0].queued < n {
            assert!(Instant::now() < deadline, "{n} requests never queued");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Holds one run at the gate, then queues `requests` one after another.
    async fn hold_then_queue(
        &self,
        requests: Vec<Request<Body>>,
    ) -> Vec<tokio::task::JoinHandle<axum::response::Response>> {
        let mut answers = vec![self.send(invocation(40, 30, ""))];
        let entered = self.gate.clone();
        tokio::task::spawn_blocking(move || entered.wait_entered(1))
            .await
            .expect("the first request runs");
        for (k, request) in requests.into_iter().enumerate() {
            answers.push(self.send(request));
            self.until_queued(k + 1).await;
        }
        answers
    }

    /// Opens the gate, requires every answer to be a 200, and says the order the runs
    /// went in (each by its image's width).
    async fn release_all_ok(
        &self,
        answers: Vec<tokio::task::JoinHandle<axum::response::Response>>,
    ) -> Vec<Vec<u32>> {
        self.gate.set_open(true);
        let mut statuses = Vec::new();
        for answer in answers {
            statuses.push(answer.await.expect("client task").status());
        }
        assert!(
            statuses.iter().all(|s| *s == StatusCode::OK),
            "{statuses:?}"
        );
        self.gate.ran()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_runs_by_the_priority_clients_give() {
    let served = serve(Scheduling::Cost);
    // Queued least urgent first; widths name them. No priority is Triton's middle, 5.
    let answers = served
        .hold_then_queue(vec![
            invocation(49, 30, "priority=9"),
            invocation(45, 30, ""),
            v2_infer(42, 30, serde_json::json!({"priority": 2})),
            invocation(41, 30, "priority=1"),
        ])
        .await;
    assert_eq!(
        served.release_all_ok(answers).await,
        vec![vec![40], vec![41], vec![42], vec![45], vec![49]]
    );
}

/// A large photo queued before a small one: by cost the small one goes first (its
/// price is a fraction of the large one's, and it waits no longer for that); by count,
/// arrival order.
async fn order_of_a_large_then_a_small(scheduling: Scheduling) -> Vec<Vec<u32>> {
    let served = serve(scheduling);
    let answers = served
        .hold_then_queue(vec![invocation(2000, 2000, ""), invocation(48, 32, "")])
        .await;
    served.release_all_ok(answers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_cost_the_shorter_request_runs_first_by_count_the_earlier() {
    assert_eq!(
        order_of_a_large_then_a_small(Scheduling::Cost).await,
        vec![vec![40], vec![48], vec![2000]]
    );
    assert_eq!(
        order_of_a_large_then_a_small(Scheduling::Count).await,
        vec![vec![40], vec![2000], vec![48]]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_cannot_be_met_is_refused_at_once() {
    let served = serve(Scheduling::Cost);
    // Before any run is measured the prior only orders: a short deadline is admitted.
    served.gate.set_open(true);
    let cold = served.ask(invocation(48, 32, "deadline-ms=50")).await;
    assert_eq!(cold.status(), StatusCode::OK);

    // Measured at a second a request, 50 ms cannot be met: 503 with the wait it would
    // take, by either protocol; a deadline it can meet is served.
    served
        .state
        .scheduler
        .seed_service_time(0, Duration::from_secs(1));
    for request in [
        invocation(48, 32, "deadline-ms=50"),
        v2_infer(48, 32, serde_json::json!({"timeout": 50_000})),
    ] {
        let refused = served.ask(request).await;
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        let retry_after: u64 = refused
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .expect("a Retry-After in seconds");
        assert!(retry_after >= 1);
        assert_refused_for_its_deadline(refused).await;
    }
    let met = served.ask(invocation(48, 32, "deadline-ms=5000")).await;
    assert_eq!(met.status(), StatusCode::OK);
    let metrics = served
        .ask(
            Request::get("/metrics")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
    let text = String::from_utf8_lossy(
        &metrics
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes(),
    )
    .into_owned();
    assert!(
        text.lines()
            .any(|l| l
                == r#"celer_inference_request_rejected_total{reason="deadline_unreachable"} 2"#),
        "{text}"
    );
}

/// A PNG of `width` x `height` cut inside its pixel data: its header says its size, its
/// decode is a 400.
fn cut_png(width: u32, height: u32) -> Vec<u8> {
    let mut png = png(width, height);
    png.truncate(png.len() - 20);
    png
}

fn cut_invocation(width: u32, height: u32, attributes: &str) -> Request<Body> {
    Request::post("/invocations")
        .header(header::CONTENT_TYPE, "image/png")
        .header("X-Amzn-SageMaker-Custom-Attributes", attributes)
        .body(Body::from(cut_png(width, height)))
        .expect("request")
}

/// The cut PNG in base64, in /invocations' JSON body and in a v2 request (its deadline in
/// the v2 parameters, microseconds).
fn cut_in_json(width: u32, height: u32, deadline_ms: u64) -> [Request<Body>; 2] {
    let b64 = base64::engine::general_purpose::STANDARD.encode(cut_png(width, height));
    let invocation = Request::post("/invocations")
        .header(header::CONTENT_TYPE, "application/json")
        .header(
            "X-Amzn-SageMaker-Custom-Attributes",
            format!("deadline-ms={deadline_ms}"),
        )
        .body(Body::from(serde_json::json!({ "image": b64 }).to_string()))
        .expect("request");
    let v2 = serde_json::json!({
        "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [b64]}],
        "outputs": [{"name": "alpha"}],
        "parameters": {"timeout": deadline_ms * 1000},
    });
    let v2 = Request::post("/v2/models/celer/infer")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(v2.to_string()))
        .expect("request");
    [invocation, v2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_cannot_be_met_is_refused_from_the_header_before_decoding() {
    let served = serve(Scheduling::Cost);
    served.gate.set_open(true);
    served
        .state
        .scheduler
        .seed_service_time(0, Duration::from_secs(1));
    // Priced from its header's size, the request is refused before its pixels are read:
    // the cut in them is never found.
    let refused = served.ask(cut_invocation(300, 200, "deadline-ms=50")).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json(refused).await["code"], "deadline_unreachable");
    // With time enough it is decoded, and the cut is a 400.
    let decoded = served
        .ask(cut_invocation(300, 200, "deadline-ms=5000"))
        .await;
    assert_eq!(decoded.status(), StatusCode::BAD_REQUEST);
    // So is an image in JSON, in /invocations' body or a v2 request, once its base64 is
    // undone.
    for request in cut_in_json(300, 200, 50) {
        let refused = served.ask(request).await;
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_refused_for_its_deadline(refused).await;
    }
    for request in cut_in_json(300, 200, 5000) {
        assert_eq!(served.ask(request).await.status(), StatusCode::BAD_REQUEST);
    }

    // By count nothing is refused for its price: the decode answers.
    let by_count = serve(Scheduling::Count);
    by_count.gate.set_open(true);
    by_count
        .state
        .scheduler
        .seed_service_time(0, Duration::from_secs(1));
    let decoded = by_count
        .ask(cut_invocation(300, 200, "deadline-ms=50"))
        .await;
    assert_eq!(decoded.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priority_or_deadline_out_of_range_is_a_400() {
    let served = serve(Scheduling::Cost);
    served.gate.set_open(true);
    for (request, code) in [
        (invocation(48, 32, "priority=10"), "bad_priority"),
        (invocation(48, 32, "deadline-ms=0"), "bad_deadline"),
        (
            invocation(48, 32, "deadline-ms=soon"),
            "bad_custom_attribute",
        ),
        (
            v2_infer(48, 32, serde_json::json!({"priority": 99})),
            "bad_priority",
        ),
    ] {
        let answer = served.ask(request).await;
        assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
        let body = json(answer).await;
        assert!(body.to_string().contains(code), "{code}: {body}");
    }
    assert!(served.gate.ran().is_empty(), "nothing refused ran");
}

/// Shortest first is aged, so small requests cannot starve a large one. Priced by the
/// prior here (nothing measured yet), a guess, it is aged one for one: a small request
/// passes a large one queued before it only if it came within the difference of their
/// prices; one that came later runs after it. 2000x2000 at 0.5 s, 48x32 at 0.1 s, a
/// difference of 0.4 s. (Measured prices are aged 16 for one: the queue's unit tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_request_priced_by_a_guess_is_passed_only_by_small_ones_within_its_price() {
    let served = serve(Scheduling::Cost);
    let mut answers = served
        .hold_then_queue(vec![invocation(2000, 2000, ""), invocation(48, 32, "")])
        .await;
    // Later than the difference of the prices: no longer ahead of the large one. (A sleep
    // is at least as long as asked, so the order does not depend on the machine's speed.)
    tokio::time::sleep(Duration::from_millis(600)).await;
    answers.push(served.send(invocation(47, 32, "")));
    served.until_queued(3).await;
    assert_eq!(
        served.release_all_ok(answers).await,
        vec![vec![40], vec![48], vec![2000], vec![47]]
    );
}

/// Each protocol's answers teach the server how long an answer of their kind takes after
/// its run; that time is kept off later requests' deadlines (`Terms::answer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_timed_by_kind_once_made() {
    use celer::codec::ImageFormat;
    use celer::http::answer_time::AnswerKind;
    use celer::sched::Work;
    let served = serve(Scheduling::Cost);
    served.gate.set_open(true);
    let alpha = AnswerKind::Image {
        output: OutputKind::Alpha,
        format: ImageFormat::Png,
    };
    let work = Work::of_image(300, 200, false);
    let kept = |kind| served.state.answers.allowance(kind, work).kept();
    assert_eq!(
        kept(alpha),
        Duration::ZERO,
        "nothing is kept before an answer"
    );
    for _ in 0..3 {
        let answered = served.ask(invocation(300, 200, "")).await;
        assert_eq!(answered.status(), StatusCode::OK);
    }
    assert!(kept(alpha) > Duration::ZERO);
    assert_eq!(kept(AnswerKind::V2Rest), Duration::ZERO);
    let answered = served.ask(v2_infer(300, 200, serde_json::json!({}))).await;
    assert_eq!(answered.status(), StatusCode::OK);
    assert!(kept(AnswerKind::V2Rest) > Duration::ZERO);
}
