//! What SageMaker's hosting modes add to the front end: `GET /execution-parameters`, which
//! a batch transform job asks before it sends anything (how many requests at once, how
//! large), and the response limit, checked before an answer is sent: a real-time or
//! serverless endpoint drops a response over its cap, so the client gets a clear refusal
//! from celer instead.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

use super::error::ApiError;
use super::negotiate::Wanted;
use super::AppState;
use crate::codec::decode::DecodeLimits;
use crate::codec::ImageFormat;
use crate::config::hosting::{BatchJob, BatchStrategy, Explicit};
use crate::config::{HostingMode, HostingPlan};
use crate::sched::DeviceView;
use crate::spec::OutputKind;

/// The hosting settings the handlers read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosting {
    pub mode: HostingMode,
    /// `None`: no limit.
    pub max_response_bytes: Option<usize>,
    /// `MaxPayloadInMB` for `/execution-parameters`.
    pub max_payload_in_mb: u64,
    /// The transform job's own `MaxConcurrentTransforms`, when it set one.
    pub job_concurrency: Option<usize>,
    /// Requests admitted at once (the router's in-flight limit): the concurrency offered
    /// to a job never exceeds it, so that no request of the job is refused.
    pub admission_limit: usize,
}

impl Default for Hosting {
    /// Real-time hosting with its default limits, for a state built without a plan.
    fn default() -> Self {
        let plan = HostingPlan::resolve(
            None,
            Explicit::default(),
            BatchJob::default(),
            DecodeLimits::default().max_pixels,
        );
        Self::from_plan(&plan, usize::MAX)
    }
}

impl Hosting {
    pub fn from_plan(plan: &HostingPlan, admission_limit: usize) -> Self {
        Self {
            mode: plan.mode,
            max_response_bytes: plan.max_response_bytes,
            max_payload_in_mb: plan.max_payload_in_mb(),
            job_concurrency: plan.job.max_concurrent,
            admission_limit,
        }
    }

    /// `MaxConcurrentTransforms`: the job's own when it set one; else two per replica of
    /// every healthy device (one running, one decoded and waiting, so a replica never
    /// idles while its next image is read and decoded), within the admission limit.
    pub fn concurrency(&self, devices: &[DeviceView]) -> usize {
        if let Some(n) = self.job_concurrency {
            return n;
        }
        let replicas: usize = devices
            .iter()
            .filter(|d| d.healthy)
            .map(|d| d.replicas)
            .sum();
        (2 * replicas).min(self.admission_limit).max(1)
    }

    /// Refuses an answer of `len` bytes over the response limit, saying what to ask for
    /// instead.
    pub fn check_response(
        &self,
        len: usize,
        wanted: Wanted,
        (width, height): (u32, u32),
    ) -> Result<(), ApiError> {
        let Some(limit) = self.max_response_bytes.filter(|&limit| len > limit) else {
            return Ok(());
        };
        let what = match wanted.kind {
            OutputKind::Cutout => format!(
                "a {width}x{height} RGBA cut-out as {}",
                wanted.format.name()
            ),
            OutputKind::Alpha => format!("a {width}x{height} alpha {}", wanted.format.name()),
            OutputKind::Trimap => format!("a {width}x{height} trimap {}", wanted.format.name()),
            OutputKind::Json => format!("JSON with three {width}x{height} PNGs in base64"),
        };
        let mut instead = Vec::new();
        if matches!(wanted.kind, OutputKind::Cutout | OutputKind::Json) {
            instead.push(
                "`output=alpha` in X-Amzn-SageMaker-Custom-Attributes (the mask alone, a \
                 fraction of the size: apply it to your copy of the image)"
                    .to_string(),
            );
        }
        if wanted.kind == OutputKind::Cutout && wanted.format == ImageFormat::Png {
            instead.push(
                "`Accept: image/webp` (the same pixels as lossless WebP, smaller)".to_string(),
            );
        }
        if wanted.kind == OutputKind::Json {
            instead.push("`Accept: image/webp` (one image instead of three in base64)".into());
        }
        instead.push("a smaller image".into());
        if matches!(self.mode, HostingMode::Realtime | HostingMode::Serverless) {
            instead.push(
                "asynchronous inference (CELER_HOSTING=async), whose answers go to S3 \
                 without this cap"
                    .into(),
            );
        }
        Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "response_too_large",
            format!(
                "the answer, {what}, is {len} bytes, over this server's response limit of \
                 {limit} bytes ({} hosting: SageMaker does not deliver a larger response); \
                 ask for {}",
                self.mode,
                instead.join(", or ")
            ),
        ))
    }
}

/// `GET /execution-parameters`: what a batch transform job that leaves them unset should
/// use. `MaxConcurrentTransforms` follows the devices that are up now.
pub async fn execution_parameters(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let hosting = &state.hosting;
    Json(serde_json::json!({
        "MaxConcurrentTransforms": hosting.concurrency(&state.scheduler.devices()),
        "BatchStrategy": BatchStrategy::SingleRecord.name(),
        "MaxPayloadInMB": hosting.max_payload_in_mb,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(replicas: usize, healthy: bool) -> DeviceView {
        DeviceView {
            name: "d".into(),
            replicas,
            healthy,
            outstanding: 0,
            queued: 0,
            running: 0,
            service_s: None,
            prices: None,
            overrun: 1.0,
            expected_wait_s: None,
        }
    }

    #[test]
    fn concurrency_follows_the_healthy_replicas_within_admission() {
        let mut h = Hosting::default();
        assert_eq!(h.concurrency(&[device(2, true)]), 4);
        assert_eq!(h.concurrency(&[device(2, true), device(3, false)]), 4);
        assert_eq!(h.concurrency(&[device(2, true), device(3, true)]), 10);
        assert_eq!(h.concurrency(&[device(2, false)]), 1);
        h.admission_limit = 3;
        assert_eq!(h.concurrency(&[device(2, true), device(3, true)]), 3);
        h.job_concurrency = Some(24);
        assert_eq!(h.concurrency(&[device(2, true)]), 24);
    }

    #[test]
    fn an_answer_over_the_limit_is_refused_saying_what_to_ask_for() {
        let h = Hosting::default();
        assert_eq!(h.max_response_bytes, Some(6_000_000));
        let cutout = Wanted {
            kind: OutputKind::Cutout,
            format: ImageFormat::Png,
        };
        assert!(h.check_response(6_000_000, cutout, (4032, 3024)).is_ok());
        let e = h
            .check_response(6_000_001, cutout, (4032, 3024))
            .unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::PAYLOAD_TOO_LARGE, "response_too_large")
        );
        for hint in [
            "4032x3024 RGBA cut-out as PNG",
            "6000001 bytes",
            "limit of 6000000",
            "output=alpha",
            "image/webp",
            "smaller image",
            "CELER_HOSTING=async",
        ] {
            assert!(e.message.contains(hint), "{hint}: {}", e.message);
        }
        let webp = Wanted {
            format: ImageFormat::Webp,
            ..cutout
        };
        let e = h.check_response(7_000_000, webp, (4032, 3024)).unwrap_err();
        assert!(!e.message.contains("Accept: image/webp"), "{}", e.message);
        let unlimited = Hosting {
            max_response_bytes: None,
            ..Hosting::default()
        };
        assert!(unlimited.check_response(usize::MAX, cutout, (1, 1)).is_ok());
    }
}
