//! `GET /metrics`: every figure in the Prometheus text format (0.0.4, as Triton serves
//! it; see `exposition`). The registry belongs to the app state, not to the process, so
//! any number of servers can live in one process (tests). This module adds the HTTP
//! figures (requests by path, status and outcome, their end-to-end time, the time of
//! each pipeline stage), and at scrape time Triton's (`triton`), the process's
//! (`process`) and the signals to scale on (`write_load`).

mod exposition;
mod process;
mod triton;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::access::Inference;
use super::AppState;
use crate::matte::StageTimings;
use crate::replica::MatteScheduler;
use crate::sched::metrics::{latency_us, us, DeviceLabel, HistogramFamily};
use crate::spec::ModelPrecision;
use exposition::{Exposition, Kind};
use process::ProcessMetrics;
use triton::{Failure, SchedulerTotals, TritonTotals};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabel {
    path: &'static str,
    status: u16,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GrpcLabel {
    method: &'static str,
    code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabel {
    path: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: &'static str,
}

/// The model stage, by the precision its device runs the segmentation model in.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelStageLabel {
    precision: &'static str,
}

/// The HTTP figures and the registry that `/metrics` encodes.
pub struct HttpMetrics {
    registry: Registry,
    requests: Family<RequestLabel, Counter>,
    grpc_requests: Family<GrpcLabel, Counter>,
    duration_us: HistogramFamily<PathLabel>,
    stage_us: HistogramFamily<StageLabel>,
    /// The model stage's times on devices whose precision is known.
    model_stage_us: HistogramFamily<ModelStageLabel>,
    /// Each device's (by label) segmentation precision.
    model_precision: Vec<(String, ModelPrecision)>,
    /// Triton's families are per model: this one's name.
    model: String,
    triton: TritonTotals,
    process: ProcessMetrics,
}

impl HttpMetrics {
    /// A registry holding the HTTP figures and the router's (`sched`), for the model
    /// named `model`.
    pub fn new(sched: &crate::sched::SchedMetrics, model: &str) -> Self {
        let mut registry = Registry::default();
        sched.register(&mut registry);
        let requests = Family::<RequestLabel, Counter>::default();
        let grpc_requests = Family::<GrpcLabel, Counter>::default();
        let duration_us: HistogramFamily<PathLabel> = Family::new_with_constructor(latency_us);
        let stage_us: HistogramFamily<StageLabel> = Family::new_with_constructor(latency_us);
        let model_stage_us: HistogramFamily<ModelStageLabel> =
            Family::new_with_constructor(latency_us);
        let r = registry.sub_registry_with_prefix("celer");
        r.register(
            "http_requests",
            "HTTP requests by path, status and outcome (success, client_error, rejected, server_error)",
            requests.clone(),
        );
        r.register(
            "grpc_requests",
            "gRPC inference calls by method and status code (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)",
            grpc_requests.clone(),
        );
        r.register(
            "http_request_duration_us",
            "Time from request to response (a gRPC call's path is its method), microseconds",
            duration_us.clone(),
        );
        r.register(
            "inference_stage_duration_us",
            "Time of each pipeline stage of successful requests, microseconds",
            stage_us.clone(),
        );
        r.register(
            "inference_model_stage_duration_us",
            "Time of the model stage of successful requests by the precision the device runs the segmentation model in (fp32, fp16, int8), microseconds",
            model_stage_us.clone(),
        );
        Self {
            registry,
            requests,
            grpc_requests,
            duration_us,
            stage_us,
            model_stage_us,
            model_precision: Vec::new(),
            model: model.to_string(),
            triton: TritonTotals::default(),
            process: ProcessMetrics::default(),
        }
    }

    /// With each device's (by label) segmentation precision, for the model stage's label.
    pub fn with_model_precision(mut self, precision: Vec<(String, ModelPrecision)>) -> Self {
        self.model_precision = precision;
        self
    }

    fn observe_stages(&self, device: &str, timings: &StageTimings) {
        for (stage, d) in timings.stages() {
            if !d.is_zero() {
                self.stage_us
                    .get_or_create(&StageLabel { stage })
                    .observe(us(d));
            }
        }
        let precision = self
            .model_precision
            .iter()
            .find(|(d, _)| d == device)
            .map(|(_, p)| p.as_str());
        if let (Some(precision), false) = (precision, timings.model.is_zero()) {
            self.model_stage_us
                .get_or_create(&ModelStageLabel { precision })
                .observe(us(timings.model));
        }
    }

    fn observe_request(&self, path: &'static str, status: StatusCode, took: Duration) {
        let outcome = match status.as_u16() {
            200..=399 => "success",
            503 | 429 => "rejected",
            400..=499 => "client_error",
            _ => "server_error",
        };
        self.duration_us
            .get_or_create(&PathLabel { path })
            .observe(us(took));
        self.requests
            .get_or_create(&RequestLabel {
                path,
                status: status.as_u16(),
                outcome,
            })
            .inc();
    }

    /// An inference request's end: its stages and Triton's totals when it was answered
    /// with a result (the handler set `Inference`), else a failure by its status.
    fn observe_inference(&self, status: StatusCode, took: Duration, inference: Option<&Inference>) {
        match inference {
            Some(i) if status.is_success() => {
                self.observe_stages(&i.device, &i.stages);
                self.triton.success(took, i.queued, &i.stages);
            }
            _ => {
                let why = match status.as_u16() {
                    503 | 429 => Failure::Rejected,
                    400..=499 => Failure::Other,
                    _ => Failure::Backend,
                };
                self.triton.failure(why, took);
            }
        }
    }

    /// A gRPC `ModelInfer` call's end: counted by its gRPC code, timed, and in Triton's
    /// totals as a REST inference is (`status`: its refusal's HTTP equivalent, or 200).
    pub fn observe_grpc_inference(
        &self,
        code: &'static str,
        status: StatusCode,
        took: Duration,
        inference: Option<&Inference>,
    ) {
        const METHOD: &str = "/inference.GRPCInferenceService/ModelInfer";
        self.grpc_requests
            .get_or_create(&GrpcLabel {
                method: METHOD,
                code,
            })
            .inc();
        self.duration_us
            .get_or_create(&PathLabel { path: METHOD })
            .observe(us(took));
        self.observe_inference(status, took, inference);
    }

    /// Every figure, in the Prometheus text format.
    pub fn encode(&self, scheduler: &MatteScheduler) -> Result<String, std::fmt::Error> {
        let mut openmetrics = String::new();
        prometheus_client::encoding::text::encode(&mut openmetrics, &self.registry)?;
        let mut e = Exposition::new(exposition::from_openmetrics(&openmetrics));
        self.triton
            .write(&mut e, &self.model, &scheduler_totals(scheduler));
        write_load(&mut e, scheduler);
        self.process.write(&mut e);
        Ok(e.finish())
    }
}

/// Triton's figures that the scheduler keeps, summed over devices.
fn scheduler_totals(scheduler: &MatteScheduler) -> SchedulerTotals {
    let m = scheduler.metrics();
    let mut totals = SchedulerTotals {
        executions: 0,
        canceled: 0,
        pending: 0,
    };
    for d in scheduler.devices() {
        let label = DeviceLabel { device: d.name };
        totals.executions += m.exec_count.get_or_create(&label).get();
        totals.canceled += m.cancelled.get_or_create(&label).get();
        totals.pending += d.queued as u64;
    }
    totals
}

/// The signals to scale on, for SageMaker inference-component autoscaling (a
/// `ContainerMetricsConfig` scraping `/metrics`) and a Kubernetes HPA on a Prometheus
/// adapter: the wait a request admitted now should expect before a replica starts it,
/// and the share of what celer admits (replicas running plus queue places; at 1 it
/// answers 503) that is taken. Server-wide, and per device.
fn write_load(e: &mut Exposition, scheduler: &MatteScheduler) {
    let limit = scheduler.admission_limit().max(1);
    e.single(
        "celer_expected_queue_wait_seconds",
        "Expected wait before a replica starts a request admitted now, seconds (0 before a service time is measured)",
        Kind::Gauge,
        scheduler.estimated_wait().map_or(0.0, |w| w.as_secs_f64()),
    );
    e.single(
        "celer_capacity_in_use_ratio",
        "Requests admitted and not yet answered over the most admitted at once (at 1, requests are refused with 503)",
        Kind::Gauge,
        scheduler.in_flight() as f64 / limit as f64,
    );
    let devices = scheduler.devices();
    let capacity = scheduler.queue_capacity();
    let labels: Vec<[(&str, &str); 1]> = devices
        .iter()
        .map(|d| [("device", d.name.as_str())])
        .collect();
    let wait: Vec<f64> = devices
        .iter()
        .map(|d| d.expected_wait_s.unwrap_or(0.0))
        .collect();
    e.family(
        "celer_device_expected_queue_wait_seconds",
        "Expected wait before one of the device's replicas starts a request placed on it now, seconds",
        Kind::Gauge,
        labels.iter().zip(&wait).map(|(l, w)| (&l[..], *w)),
    );
    // The cost model's prices, for a reader of the estimates above: what a request of a
    // given size is expected to take on each device (0 before its first run).
    let prices: Vec<_> = devices.iter().map(|d| d.prices).collect();
    e.family(
        "celer_device_cost_fixed_seconds",
        "The cost model's fixed part of a request on the device (its models), seconds",
        Kind::Gauge,
        labels
            .iter()
            .zip(&prices)
            .map(|(l, p)| (&l[..], p.map_or(0.0, |p| p.fixed_s))),
    );
    e.family(
        "celer_device_cost_per_megapixel_seconds",
        "The cost model's part of a request on the device that grows with its pixels, seconds per megapixel (the cut-out's composite not included)",
        Kind::Gauge,
        labels
            .iter()
            .zip(&prices)
            .map(|(l, p)| (&l[..], p.map_or(0.0, |p| p.per_pixel_s * 1e6))),
    );
    e.family(
        "celer_device_cost_overrun_ratio",
        "The margin a deadline is kept with on the device: the slowest of its recent runs against its price (at least 1)",
        Kind::Gauge,
        labels.iter().zip(&devices).map(|(l, d)| (&l[..], d.overrun)),
    );
    e.family(
        "celer_device_capacity_in_use_ratio",
        "Requests queued and running on the device over its replicas plus its queue places",
        Kind::Gauge,
        labels.iter().zip(&devices).map(|(l, d)| {
            let places = (d.replicas + capacity).max(1);
            (&l[..], d.outstanding as f64 / places as f64)
        }),
    );
}

/// Counts and times every routed request (except scrapes of `/metrics` itself).
pub async fn track(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    // A route layer: only matched routes get here; the label is one of a few fixed
    // values (bounded cardinality, no allocation), v2's inferences under one whatever
    // model name and version their path carries.
    let path = match request.uri().path() {
        "/ping" => "/ping",
        "/invocations" => "/invocations",
        p if p.starts_with("/v2/models/") && p.ends_with("/infer") => "/v2/models/infer",
        _ => return next.run(request).await,
    };
    let start = Instant::now();
    let response = next.run(request).await;
    let took = start.elapsed();
    state.metrics.observe_request(path, response.status(), took);
    if path != "/ping" {
        state.metrics.observe_inference(
            response.status(),
            took,
            response.extensions().get::<Inference>(),
        );
    }
    response
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    state.scheduler.refresh_gauges();
    match state.metrics.encode(&state.scheduler) {
        Ok(text) => {
            let mut response = (StatusCode::OK, Body::from(text)).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(exposition::CONTENT_TYPE),
            );
            response
        }
        Err(e) => {
            crate::http::error::ApiError::internal(format!("encoding metrics: {e}")).into_response()
        }
    }
}
