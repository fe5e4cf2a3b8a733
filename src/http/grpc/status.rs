//! Refusals as gRPC statuses. The request path's errors are `ApiError`s (an HTTP status
//! and a stable code); here they become the status a gRPC client expects, the code in
//! the message and in `celer-error-code`, and overload's retry hint in the trailers as
//! gRPC's retry design reads it (`grpc-retry-pushback-ms`).

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::http::error::ApiError;

/// The gRPC code of a refusal:
/// - the client's mistakes (400, 415, 422, and an image over the pixel limits) are
///   `INVALID_ARGUMENT`; a message or answer over the size limits `OUT_OF_RANGE`, as
///   tonic's own limit on received messages answers;
/// - an unknown model or version `NOT_FOUND`;
/// - overload (every slot taken, or the expected wait over the budget) `RESOURCE_EXHAUSTED`
///   with a retry hint; a deadline that passed `DEADLINE_EXCEEDED`; no device able to
///   serve, or a server stopping, `UNAVAILABLE`;
/// - a server fault `INTERNAL`.
pub fn code_of(e: &ApiError) -> Code {
    match (e.status.as_u16(), e.code) {
        (404, _) => Code::NotFound,
        (503, "overloaded") => Code::ResourceExhausted,
        (503, "deadline_exceeded" | "deadline_unreachable") | (408, _) => Code::DeadlineExceeded,
        (503, _) => Code::Unavailable,
        (413, "too_many_pixels" | "image_too_long") => Code::InvalidArgument,
        (413, _) => Code::OutOfRange,
        (400..=499, _) => Code::InvalidArgument,
        (500, _) => Code::Internal,
        _ => Code::Unknown,
    }
}

/// The code's name as gRPC spells it, for metrics and logs.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

pub fn status_of(e: &ApiError) -> Status {
    let mut status = Status::new(code_of(e), format!("{} ({})", e.message, e.code));
    let metadata = status.metadata_mut();
    metadata.insert("celer-error-code", MetadataValue::from_static(e.code));
    if let Some(s) = e.retry_after_s {
        metadata.insert(
            "grpc-retry-pushback-ms",
            MetadataValue::from(u64::from(s) * 1000),
        );
        metadata.insert("retry-after", MetadataValue::from(s));
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::SubmitError;
    use axum::http::StatusCode;

    #[test]
    fn refusals_get_the_codes_grpc_clients_expect() {
        let overload = ApiError::from(SubmitError::Overloaded {
            capacity: 4,
            retry_after_ms: 1500,
        });
        let s = status_of(&overload);
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.metadata().get("grpc-retry-pushback-ms").unwrap(), "2000");
        assert_eq!(s.metadata().get("celer-error-code").unwrap(), "overloaded");
        let cases = [
            (
                ApiError::bad_request("bad_inference_request", "x"),
                Code::InvalidArgument,
            ),
            (
                ApiError::new(StatusCode::NOT_FOUND, "unknown_model", "x"),
                Code::NotFound,
            ),
            (
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_many_pixels", "x"),
                Code::InvalidArgument,
            ),
            (
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "response_too_large", "x"),
                Code::OutOfRange,
            ),
            (
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "deadline_exceeded", "x"),
                Code::DeadlineExceeded,
            ),
            (ApiError::from(SubmitError::Stopped), Code::Unavailable),
            (
                ApiError::from(SubmitError::NoHealthyDevice),
                Code::Unavailable,
            ),
            (
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", "x"),
                Code::Internal,
            ),
        ];
        for (e, code) in cases {
            assert_eq!(code_of(&e), code, "{e:?}");
        }
    }
}
