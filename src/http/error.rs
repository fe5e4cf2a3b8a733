//! The one place where errors become HTTP answers. Every refusal is a JSON body
//! `{"error": "...", "code": "..."}`; client mistakes get a 4xx that says what to fix,
//! server faults a 5xx whose details go to the log, not to the client.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::codec::decode::DecodeError;
use crate::http::body::BodyError;
use crate::sched::{JobError, SubmitError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// A stable machine-readable reason, e.g. `payload_too_large`.
    pub code: &'static str,
    pub message: String,
    /// Seconds, for 503s.
    pub retry_after_s: Option<u32>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    code: &'a str,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_s: None,
        }
    }

    /// 413 `payload_too_large`: `what` (the request body, the image at `url`) is over
    /// `limit` bytes.
    pub fn payload_too_large(what: &str, limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("{what} is over the limit of {limit} bytes"),
        )
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// A server fault: the details are logged here, the client gets a generic message.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the server failed to process the image; see the server log",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&Body {
            error: &self.message,
            code: self.code,
        })
        .unwrap_or_default();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.retry_after_s {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

impl From<DecodeError> for ApiError {
    fn from(e: DecodeError) -> Self {
        let (status, code) = match &e {
            DecodeError::Empty => (StatusCode::BAD_REQUEST, "empty_body"),
            DecodeError::UnknownFormat => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unknown_format"),
            DecodeError::UnsupportedFormat { .. } => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_format")
            }
            DecodeError::TooManyPixels { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_many_pixels"),
            DecodeError::TooSmall { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "image_too_small"),
            DecodeError::TooLong { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "image_too_long"),
            DecodeError::Corrupt(_) => (StatusCode::BAD_REQUEST, "corrupt_image"),
            DecodeError::Truncated(_) => (StatusCode::BAD_REQUEST, "truncated_image"),
        };
        Self::new(status, code, e.to_string())
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        // Whole seconds, rounded up, at least 1: the header has no fractions.
        let retry_after_s = e
            .retry_after()
            .map(|d| d.as_millis().div_ceil(1000).clamp(1, 3600) as u32);
        match e {
            SubmitError::Overloaded { .. } | SubmitError::WaitTooLong { .. } => Self {
                retry_after_s,
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    format!("the server is at capacity ({e}); retry later"),
                )
            },
            SubmitError::DeadlineUnreachable { .. } => Self {
                retry_after_s,
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "deadline_unreachable",
                    format!("{e}: refused at once rather than answered late; retry later or with a longer deadline"),
                )
            },
            // The same code as a deadline out of reach: to the client it is one (its
            // deadline cannot be kept now), and the same retry answers it.
            SubmitError::AdmittedFirst { .. } => Self {
                retry_after_s,
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "deadline_unreachable",
                    format!("{e}: refused at once; retry later or with a longer deadline"),
                )
            },
            SubmitError::NoHealthyDevice => Self {
                retry_after_s,
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_healthy_device",
                    "no device can take the request now; retry later",
                )
            },
            SubmitError::Stopped => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the server is shutting down",
            ),
        }
    }
}

impl From<BodyError> for ApiError {
    fn from(e: BodyError) -> Self {
        match e {
            BodyError::Timeout { .. } => {
                Self::new(StatusCode::REQUEST_TIMEOUT, "body_timeout", e.to_string())
            }
            BodyError::OverBudget { .. } => Self {
                retry_after_s: Some(1),
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", e.to_string())
            },
        }
    }
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::DeadlineExceeded => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "deadline_exceeded",
                "the request waited past its deadline; retry later",
            ),
            JobError::DeadlineUnreachable => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "deadline_unreachable",
                "the request waited behind more urgent work until it could no longer finish by its deadline; retry later or with a longer deadline",
            ),
            JobError::Rejected(e) => e.into(),
            other => Self::internal(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_refused_to_keep_admitted_ones_in_time_is_a_503_to_retry() {
        let e = ApiError::from(SubmitError::AdmittedFirst {
            retry_after_ms: 1200,
        });
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        // The code a deadline out of reach has: a client handles both alike.
        assert_eq!(e.code, "deadline_unreachable");
        assert!(e.message.contains("admitted before it"), "{}", e.message);
        // Whole seconds, rounded up.
        assert_eq!(e.retry_after_s, Some(2));
    }
}
