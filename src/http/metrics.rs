//! `GET /metrics`: every figure in the Prometheus (OpenMetrics) text format. The registry
//! belongs to the app state, not to the process, so any number of servers can live in one
//! process (tests). This module adds the HTTP figures: requests by path, status and
//! outcome, their end-to-end time, and the time of each pipeline stage.

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

use super::AppState;
use crate::matte::StageTimings;
use crate::sched::metrics::{latency_us, us, HistogramFamily};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabel {
    path: &'static str,
    status: u16,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabel {
    path: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: &'static str,
}

/// The HTTP figures and the registry that `/metrics` encodes.
pub struct HttpMetrics {
    registry: Registry,
    requests: Family<RequestLabel, Counter>,
    duration_us: HistogramFamily<PathLabel>,
    stage_us: HistogramFamily<StageLabel>,
}

impl HttpMetrics {
    /// A registry holding the HTTP figures and the router's (`sched`).
    pub fn new(sched: &crate::sched::SchedMetrics) -> Self {
        let mut registry = Registry::default();
        sched.register(&mut registry);
        let requests = Family::<RequestLabel, Counter>::default();
        let duration_us: HistogramFamily<PathLabel> = Family::new_with_constructor(latency_us);
        let stage_us: HistogramFamily<StageLabel> = Family::new_with_constructor(latency_us);
        let r = registry.sub_registry_with_prefix("celer");
        r.register(
            "http_requests",
            "HTTP requests by path, status and outcome (success, client_error, rejected, server_error)",
            requests.clone(),
        );
        r.register(
            "http_request_duration_us",
            "Time from request to response, microseconds",
            duration_us.clone(),
        );
        r.register(
            "inference_stage_duration_us",
            "Time of each pipeline stage of successful requests, microseconds",
            stage_us.clone(),
        );
        Self {
            registry,
            requests,
            duration_us,
            stage_us,
        }
    }

    pub fn observe_stages(&self, timings: &StageTimings) {
        for (stage, d) in timings.stages() {
            if !d.is_zero() {
                self.stage_us
                    .get_or_create(&StageLabel { stage })
                    .observe(us(d));
            }
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

    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
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
    state
        .metrics
        .observe_request(path, response.status(), start.elapsed());
    response
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    state.scheduler.refresh_gauges();
    match state.metrics.encode() {
        Ok(text) => {
            let mut response = (StatusCode::OK, Body::from(text)).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            response
        }
        Err(e) => {
            crate::http::error::ApiError::internal(format!("encoding metrics: {e}")).into_response()
        }
    }
}
