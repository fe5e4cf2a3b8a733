//! The HTTP front end: the SageMaker container contract (`GET /ping`,
//! `POST /invocations`) and `GET /metrics`. Handlers parse and check requests, hand
//! decoded images to the router and encode answers on the blocking pool; no pixel work
//! runs on the executor.

pub mod access;
pub mod answer_time;
pub mod body;
pub mod error;
mod fetch;
pub mod grpc;
pub mod hosting;
mod invocations;
pub mod metrics;
mod negotiate;
pub mod server;
mod spans;
pub(crate) mod urgency;
pub mod v2;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::config::RequestLimits;
use crate::host::work_pool::WorkPool;
use crate::pixels::SharedAlloc;
use crate::replica::MatteScheduler;
use crate::sched::Readiness;
use crate::spec::{ModelPrecision, OutputKind};
use crate::trace::Tracer;
use error::ApiError;

pub use fetch::UrlFetcher;
pub use hosting::Hosting;
pub use metrics::HttpMetrics;

/// Everything a handler needs, shared by all requests.
pub struct AppState {
    pub scheduler: MatteScheduler,
    pub limits: RequestLimits,
    pub default_output: OutputKind,
    /// `None`: JSON bodies may not name a `url`.
    pub fetcher: Option<UrlFetcher>,
    /// Send per-stage times in a `Server-Timing` header.
    pub server_timing: bool,
    /// The registry behind `/metrics`, holding the router's figures too.
    pub metrics: HttpMetrics,
    /// The hosting mode's response limit and batch transform parameters.
    pub hosting: Hosting,
    /// The model as the Open Inference Protocol names it.
    pub model: ServedModel,
    /// Where decoded pixels go: the GPUs' page-locked blocks, or the heap.
    pub pixels: SharedAlloc,
    /// Traces requests when an OTLP endpoint is set.
    pub tracer: Option<Tracer>,
    /// Readiness (`/ping`, v2's ready) says 200 while an interim device serves and the
    /// GPUs' engines build (`--ready-while-building`), not only once every device has
    /// loaded.
    pub ready_while_building: bool,
    /// How long answers take to make after their runs, by kind: kept off the deadline.
    pub answers: answer_time::AnswerTimes,
    /// Set at SIGTERM: requests are still answered, readiness says 503 so that load
    /// balancers stop sending them.
    draining: AtomicBool,
    /// Where admitted requests' bodies are parsed and decoded and their answers encoded:
    /// one thread per admission slot, at the priority of the thread that built the state.
    pub work: WorkPool,
}

/// How the front end answers, besides the scheduler behind it: what `AppState` is built
/// from, whole.
pub struct FrontEnd {
    pub limits: RequestLimits,
    pub default_output: OutputKind,
    pub fetcher: Option<UrlFetcher>,
    pub server_timing: bool,
    pub hosting: Hosting,
    pub model: ServedModel,
    pub pixels: SharedAlloc,
    pub tracer: Option<Tracer>,
    pub ready_while_building: bool,
    /// The precision each device (by its label: `cpu`, `gpu0`) runs the segmentation
    /// model in; `/metrics` labels the model stage's times with it.
    pub model_precision: Vec<(String, ModelPrecision)>,
}

impl FrontEnd {
    /// `limits` and `default_output`; no fetching, no `Server-Timing`, real-time hosting,
    /// the model named `celer`, pixels on the heap, no tracing, and ready once every
    /// device has loaded.
    pub fn new(limits: RequestLimits, default_output: OutputKind) -> Self {
        Self {
            limits,
            default_output,
            fetcher: None,
            server_timing: false,
            hosting: Hosting::default(),
            model: ServedModel::default(),
            pixels: crate::pixels::heap(),
            tracer: None,
            ready_while_building: false,
            model_precision: Vec::new(),
        }
    }
}

/// The model's name and batching, for the v2 metadata and Triton's model configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    pub name: String,
    /// Requests per model run (1: no batching) and the wait for more.
    pub max_batch: usize,
    pub max_wait_us: u64,
}

impl Default for ServedModel {
    fn default() -> Self {
        Self {
            name: "celer".into(),
            max_batch: 1,
            max_wait_us: 0,
        }
    }
}

impl AppState {
    /// Starts the work pool from this thread: call it from a thread at the process's own
    /// priority, not from a runtime thread (see `host::priority`).
    pub fn new(scheduler: MatteScheduler, front: FrontEnd) -> Self {
        let admission_limit = scheduler.admission_limit();
        let metrics = HttpMetrics::new(scheduler.metrics(), &front.model.name)
            .with_model_precision(front.model_precision);
        Self {
            scheduler,
            limits: front.limits,
            default_output: front.default_output,
            fetcher: front.fetcher,
            server_timing: front.server_timing,
            metrics,
            hosting: front.hosting,
            model: front.model,
            pixels: front.pixels,
            tracer: front.tracer,
            ready_while_building: front.ready_while_building,
            answers: answer_time::AnswerTimes::default(),
            draining: AtomicBool::new(false),
            work: WorkPool::start("celer-work", admission_limit),
        }
    }

    /// From now on readiness answers 503; serving goes on until the listener closes.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether readiness says 200 at this stage of loading: once every device has
    /// loaded, or, with `ready_while_building`, while an interim device serves.
    pub fn loaded_enough(&self, readiness: &Readiness) -> bool {
        match readiness {
            Readiness::Ready => true,
            Readiness::Interim { .. } => self.ready_while_building,
            Readiness::Loading { .. } | Readiness::Failed(_) => false,
        }
    }
}

/// The HTTP routes (an axum `Router`; the scheduler behind them is `AppState::scheduler`).
pub fn routes(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/ping", get(ping))
        .route("/invocations", post(invocations::invocations))
        .route("/metrics", get(metrics::metrics))
        .route("/execution-parameters", get(hosting::execution_parameters))
        .route("/v2", get(v2::server_metadata))
        // KServe's published OpenAPI names the server metadata `/v2/`.
        .route("/v2/", get(v2::server_metadata))
        .route("/v2/health/live", get(v2::live))
        .route("/v2/health/ready", get(v2::ready))
        .route("/v2/models/{model}", get(v2::model_metadata))
        .route(
            "/v2/models/{model}/versions/{version}",
            get(v2::model_metadata),
        )
        .route("/v2/models/{model}/ready", get(v2::model_ready))
        .route(
            "/v2/models/{model}/versions/{version}/ready",
            get(v2::model_ready),
        )
        .route("/v2/models/{model}/config", get(v2::model_config))
        .route(
            "/v2/models/{model}/versions/{version}/config",
            get(v2::model_config),
        )
        .route("/v2/models/{model}/infer", post(v2::infer))
        .route(
            "/v2/models/{model}/versions/{version}/infer",
            post(v2::infer),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            metrics::track,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            spans::record,
        ))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outside the routes: refusals of unknown paths get an id and a line too.
        .layer(axum::middleware::from_fn(access::log))
        .with_state(state)
}

/// Unknown paths and methods get the same JSON refusal as every other error.
async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such path; this server answers GET /ping, POST /invocations and the Open Inference Protocol (KServe v2) under /v2",
    )
}

/// axum keeps the `Allow` header on this answer.
async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this server answers GET /ping and POST /invocations",
    )
}

/// 200 once every replica has loaded its models (with `--ready-while-building`, once the
/// CPU's have while the GPUs' engines build) and while a device can serve; 503 before, if
/// loading failed, while every device is unhealthy (SageMaker then replaces the
/// instance) and while draining after SIGTERM. Reads a few atomics: it never waits behind inference or a full queue.
async fn ping(State(state): State<Arc<AppState>>) -> Response {
    if state.is_draining() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "draining" })),
        )
            .into_response();
    }
    let readiness = state.scheduler.readiness();
    let loaded_enough = state.loaded_enough(&readiness);
    match readiness {
        _ if loaded_enough && !state.scheduler.devices().iter().any(|d| d.healthy) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "unhealthy", "reason": "no device can serve" })),
        )
            .into_response(),
        Readiness::Ready => Json(serde_json::json!({ "status": "ok" })).into_response(),
        Readiness::Interim { loaded, of } if loaded_enough => Json(serde_json::json!({
            "status": "ok",
            "serving": "on the CPU while the GPUs load",
            "replicas_loaded": loaded,
            "replicas": of,
        }))
        .into_response(),
        Readiness::Loading { loaded, of } | Readiness::Interim { loaded, of } => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "loading", "replicas_loaded": loaded, "replicas": of })),
        )
            .into_response(),
        Readiness::Failed(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "failed" })),
        )
            .into_response(),
    }
}
