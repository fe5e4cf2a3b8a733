//! A request's trace: when the server has a tracer (`OTEL_EXPORTER_OTLP_ENDPOINT`) and
//! the sampler takes the request, one SERVER span for the exchange, child of the caller's
//! `traceparent` span when one was sent, and for an inference one INTERNAL child per
//! stage: decode, queue, preprocess, model, trimap, matting, composite, encode (those that
//! ran). Health checks and scrapes are not traced: a load balancer's probes every few
//! seconds would bury the requests. gRPC's `ModelInfer` (`http::grpc`) gets the same
//! tree, its server span named as OpenTelemetry's RPC conventions name it
//! (`record_grpc`).
//!
//! Where the stages sit: decode ends when the handler hands the image on, the queue wait
//! ends when the replica starts the run, the replica's stages follow each other from that
//! start with their measured times (the few microseconds between them are not measured,
//! so each is placed right after the one before), and encode ends when the answer is
//! ready. A batched run's stage times are the batch's.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;

use super::access::{Inference, RequestId, TraceRef};
use super::AppState;
use crate::trace::{Sampled, SpanId, SpanKind, SpanRecord, Status, TraceParent, Tracer, Value};

pub async fn record(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(tracer) = state.tracer.as_ref() else {
        return next.run(request).await;
    };
    // Nothing is copied out of the request until it is known to be traced.
    let matched = request
        .extensions()
        .get::<MatchedPath>()
        .map_or(request.uri().path(), |p| p.as_str());
    if matched == "/ping" || matched == "/metrics" || matched.starts_with("/v2/health/") {
        return next.run(request).await;
    }
    let headers = request.headers();
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let parent = header("traceparent").and_then(|tp| TraceParent::parse(tp, header("tracestate")));
    let Some(sampled) = tracer.sample(parent) else {
        return next.run(request).await;
    };
    let route = matched.to_string();
    let method = request.method().to_string();
    let path = request.uri().path().to_string();
    let request_id = request.extensions().get::<RequestId>().map(|r| r.0.clone());
    let start = Instant::now();
    let mut response = next.run(request).await;
    let end = Instant::now();

    let status = response.status();
    let mut attributes = vec![
        (
            Cow::Borrowed("http.request.method"),
            Value::Str(method.clone().into()),
        ),
        (
            Cow::Borrowed("http.route"),
            Value::Str(route.clone().into()),
        ),
        (Cow::Borrowed("url.path"), Value::Str(path.into())),
        (
            Cow::Borrowed("http.response.status_code"),
            Value::Int(i64::from(status.as_u16())),
        ),
    ];
    if let Some(id) = request_id {
        attributes.push((Cow::Borrowed("celer.request_id"), Value::Str(id.into())));
    }
    let inference = response.extensions().get::<Inference>().cloned();
    if let Some(i) = &inference {
        attributes.push((
            Cow::Borrowed("celer.device"),
            Value::Str(i.device.clone().into()),
        ));
    }
    let server = SpanRecord {
        trace_id: sampled.trace_id,
        span_id: sampled.span_id,
        parent: sampled.parent,
        trace_state: sampled.trace_state.clone(),
        name: format!("{method} {route}").into(),
        kind: SpanKind::Server,
        start_unix_ns: tracer.unix_ns(start),
        end_unix_ns: tracer.unix_ns(end),
        attributes,
        // A server span is an error for 5xx only (OpenTelemetry's HTTP conventions).
        status: if status.is_server_error() {
            Status::Error
        } else {
            Status::Unset
        },
    };
    let mut spans = vec![server];
    if let Some(i) = &inference {
        spans.extend(stage_spans(tracer, &sampled, i));
    }
    response
        .extensions_mut()
        .insert(TraceRef(sampled.trace_id.to_string()));
    tracer.record(spans);
    response
}

/// A gRPC call as its trace sees it.
pub(in crate::http) struct GrpcCall<'a> {
    /// `inference.GRPCInferenceService`.
    pub service: &'static str,
    /// `ModelInfer`.
    pub method: &'static str,
    /// The gRPC status code, and its name.
    pub code: i32,
    pub code_name: &'static str,
    pub request_id: &'a str,
    pub start: Instant,
    pub end: Instant,
}

/// The sampling decision for a gRPC call, from its `traceparent` and `tracestate`
/// metadata (W3C trace context, as gRPC's OpenTelemetry instrumentations send it).
pub(in crate::http) fn sample_grpc(
    tracer: &Tracer,
    metadata: &tonic::metadata::MetadataMap,
) -> Option<Sampled> {
    let get = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok());
    tracer.sample(get("traceparent").and_then(|tp| TraceParent::parse(tp, get("tracestate"))))
}

/// Exports a sampled gRPC call's spans: the SERVER span (`service/method`, with
/// `rpc.system`, `rpc.service`, `rpc.method` and `rpc.grpc.status_code`) and, for an
/// answered inference, its stages.
pub(in crate::http) fn record_grpc(
    tracer: &Tracer,
    sampled: &Sampled,
    call: GrpcCall<'_>,
    inference: Option<&Inference>,
) {
    let mut attributes = vec![
        (Cow::Borrowed("rpc.system"), Value::Str("grpc".into())),
        (
            Cow::Borrowed("rpc.service"),
            Value::Str(call.service.into()),
        ),
        (Cow::Borrowed("rpc.method"), Value::Str(call.method.into())),
        (
            Cow::Borrowed("rpc.grpc.status_code"),
            Value::Int(i64::from(call.code)),
        ),
        (
            Cow::Borrowed("celer.request_id"),
            Value::Str(call.request_id.to_string().into()),
        ),
    ];
    if let Some(i) = inference {
        attributes.push((
            Cow::Borrowed("celer.device"),
            Value::Str(i.device.clone().into()),
        ));
    }
    // OpenTelemetry's gRPC conventions: a server span is an error for these codes only.
    let error = matches!(
        call.code_name,
        "UNKNOWN"
            | "DEADLINE_EXCEEDED"
            | "UNIMPLEMENTED"
            | "INTERNAL"
            | "UNAVAILABLE"
            | "DATA_LOSS"
    );
    let server = SpanRecord {
        trace_id: sampled.trace_id,
        span_id: sampled.span_id,
        parent: sampled.parent,
        trace_state: sampled.trace_state.clone(),
        name: format!("{}/{}", call.service, call.method).into(),
        kind: SpanKind::Server,
        start_unix_ns: tracer.unix_ns(call.start),
        end_unix_ns: tracer.unix_ns(call.end),
        attributes,
        status: if error { Status::Error } else { Status::Unset },
    };
    let mut spans = vec![server];
    if let Some(i) = inference {
        spans.extend(stage_spans(tracer, sampled, i));
    }
    tracer.record(spans);
}

/// The stages of one inference as children of the request's span.
fn stage_spans(tracer: &Tracer, request: &Sampled, i: &Inference) -> Vec<SpanRecord> {
    let s = &i.stages;
    let mut placed: Vec<(&'static str, Instant, Duration)> = vec![
        (
            "decode",
            i.decoded_at.checked_sub(s.decode).unwrap_or(i.decoded_at),
            s.decode,
        ),
        (
            "queue",
            i.started.checked_sub(i.queued).unwrap_or(i.started),
            i.queued,
        ),
    ];
    // The replica's stages: all but decode and encode, which the handler times.
    let mut at = i.started;
    for (name, took) in s.stages() {
        if name != "decode" && name != "encode" {
            placed.push((name, at, took));
            at += took;
        }
    }
    placed.push((
        "encode",
        i.encoded_at.checked_sub(s.encode).unwrap_or(i.encoded_at),
        s.encode,
    ));
    placed
        .into_iter()
        // A stage that did not run has no span; the queue's always does.
        .filter(|(name, _, took)| *name == "queue" || !took.is_zero())
        .map(|(name, from, took)| SpanRecord {
            trace_id: request.trace_id,
            span_id: SpanId::random(),
            parent: Some(request.span_id),
            trace_state: request.trace_state.clone(),
            name: Cow::Borrowed(name),
            kind: SpanKind::Internal,
            start_unix_ns: tracer.unix_ns(from),
            end_unix_ns: tracer.unix_ns(from + took),
            attributes: if name == "queue" {
                vec![(
                    Cow::Borrowed("celer.device"),
                    Value::Str(i.device.clone().into()),
                )]
            } else {
                Vec::new()
            },
            status: Status::Unset,
        })
        .collect()
}
