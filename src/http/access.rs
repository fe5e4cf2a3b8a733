//! The access log: one line per request (method, route, status, body bytes, duration,
//! and for an inference its queue wait, compute time and device), under the request's
//! id: SageMaker's `X-Amzn-SageMaker-Inference-Id`, else a client's `X-Request-Id`, else
//! one made here. The id goes back in the answer's `X-Request-Id`, so that a client, a
//! CloudWatch query and the log meet on it. Health checks (`/ping`, `/v2/health/*`) are
//! logged at debug level: a load balancer's probes every few seconds would drown the rest.

use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use http_body::Body as _;

use crate::matte::StageTimings;

pub const INFERENCE_ID: &str = "x-amzn-sagemaker-inference-id";
pub const REQUEST_ID: &str = "x-request-id";

/// What an inference handler says of its request, for the access line and the metrics:
/// set as an extension of its response.
#[derive(Debug, Clone)]
pub struct Inference {
    pub device: String,
    pub queued: Duration,
    pub compute: Duration,
    /// Each stage's time, decode and encode included.
    pub stages: StageTimings,
    /// When decoding ended, the replica's run started and encoding ended: where a trace
    /// places the stages (`http::spans`).
    pub decoded_at: Instant,
    pub started: Instant,
    pub encoded_at: Instant,
}

impl Inference {
    /// When the replica's run ended.
    pub fn run_ended(&self) -> Instant {
        self.started + self.compute
    }

    /// The answer is encoded: the stages' times, encode's included, and when it ended.
    pub fn encoded(&mut self, stages: StageTimings) {
        self.stages = stages;
        self.encoded_at = Instant::now();
    }
}

/// The request's id, as `log` chose it, for the layers inside (a request extension).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// The trace a request's spans went to (a response extension set by `http::spans`), for
/// the access line: logs and traces meet on it.
#[derive(Debug, Clone)]
pub struct TraceRef(pub String);

/// The request's id: SageMaker's, a client's, or a new one (128 random bits in hex). Only
/// printable ASCII up to 128 bytes is taken from a client, so that the id is a header
/// value and one token in a log line.
pub fn request_id(headers: &HeaderMap) -> String {
    [INFERENCE_ID, REQUEST_ID]
        .iter()
        .filter_map(|name| headers.get(*name)?.to_str().ok())
        .map(str::trim)
        .find(|id| !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:032x}", fastrand::u128(..)))
}

pub async fn log(mut request: Request, next: Next) -> Response {
    let id = request_id(request.headers());
    request.extensions_mut().insert(RequestId(id.clone()));
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let start = Instant::now();
    let mut response = next.run(request).await;
    let elapsed = start.elapsed();
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    let status = response.status().as_u16();
    let bytes = response.body().size_hint().exact();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let inference = response.extensions().get::<Inference>();
    let trace_id = response
        .extensions()
        .get::<TraceRef>()
        .map(|t| t.0.as_str());
    let health = path == "/ping" || path.starts_with("/v2/health/");
    macro_rules! access {
        ($level:ident) => {
            tracing::$level!(
                target: "celer::access",
                request_id = %id,
                method = %method,
                path = %path,
                status,
                bytes,
                duration_ms = ms(elapsed),
                device = inference.map(|i| i.device.as_str()),
                queue_ms = inference.map(|i| ms(i.queued)),
                compute_ms = inference.map(|i| ms(i.compute)),
                trace_id = trace_id.map(tracing::field::display),
                "request"
            )
        };
    }
    if health {
        access!(debug);
    } else {
        access!(info);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    axum::http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn the_id_is_sagemakers_then_the_clients_then_a_new_one() {
        assert_eq!(
            request_id(&headers(&[(INFERENCE_ID, "abc-1"), (REQUEST_ID, "mine")])),
            "abc-1"
        );
        assert_eq!(request_id(&headers(&[(REQUEST_ID, "mine")])), "mine");
        // Unprintable or overlong ids are not taken: a new one is made.
        for bad in ["has space", ""] {
            let made = request_id(&headers(&[(REQUEST_ID, bad)]));
            assert_eq!(made.len(), 32, "{bad:?} -> {made}");
            assert!(made.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        let long = "x".repeat(129);
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_str(&long).unwrap());
        assert_ne!(request_id(&h), long);
        let (a, b) = (request_id(&HeaderMap::new()), request_id(&HeaderMap::new()));
        assert_ne!(a, b, "each request its own id");
    }
}
