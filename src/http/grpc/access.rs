//! The access line of a gRPC call, written when the call ends for its client (its answer
//! delivered, its stream reset, its connection gone), with the status the client got:
//! `OK` only for an answer that was delivered. What a handler knows of its call (the
//! inference's device and times, the trace) reaches the line through a `CallNote`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::Code;

use super::status::code_name;
use crate::http::access::Inference;

/// What a handler says of its call for the access line (a request extension the
/// listener's layer sets and reads back when the call ends).
#[derive(Debug, Clone, Default)]
pub struct CallNote(Arc<Mutex<Noted>>);

#[derive(Debug, Default)]
struct Noted {
    code: Option<Code>,
    /// The client reset the stream, or its connection failed, while its message arrived.
    gone: bool,
    inference: Option<(String, Duration, Duration)>,
    trace_id: Option<String>,
}

impl CallNote {
    /// The handler's answer: its status, the inference that made it, and the trace its
    /// spans went to.
    pub fn answered(&self, code: Code, inference: Option<&Inference>, trace_id: Option<String>) {
        if let Ok(mut noted) = self.0.lock() {
            noted.code = Some(code);
            noted.inference = inference.map(|i| (i.device.clone(), i.queued, i.compute));
            noted.trace_id = trace_id;
        }
    }

    /// The client reset the stream (or lost its connection) before its message was
    /// whole: whatever the answer, it was not delivered.
    pub fn client_gone(&self) {
        if let Ok(mut noted) = self.0.lock() {
            noted.gone = true;
        }
    }

    /// The status the handler answered with, if it said.
    pub fn code(&self) -> Option<Code> {
        self.0.lock().ok()?.code
    }
}

/// How a call ended for its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The status reached the client (after the whole answer, if any).
    Delivered(Code),
    /// The answer (with this status, where the handler said) was not delivered: the
    /// client reset the stream or went away, or its connection was ended for not reading
    /// within the send timeout.
    Undelivered {
        meant: Option<Code>,
        send_timeout: bool,
    },
    /// The call was dropped before its answer was ready: the client reset the stream, its
    /// connection went, or the call's time ran out (tonic answers that `CANCELLED`).
    Cancelled,
}

impl Ending {
    /// The status the client got (or, for a call it never got an answer to, the one its
    /// library reports for a call ended under it).
    pub fn code(self) -> Code {
        match self {
            Ending::Delivered(code) => code,
            Ending::Undelivered { .. } | Ending::Cancelled => Code::Cancelled,
        }
    }
}

/// One call's line: what the layer saw and what the handler noted.
pub struct CallLine<'a> {
    pub request_id: &'a str,
    pub path: &'a str,
    pub ending: Ending,
    pub took: Duration,
    pub note: &'a CallNote,
}

/// The probes' calls, which succeed every few seconds; logged at debug level when they
/// do, as REST's health checks are.
fn probe(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/")
        || matches!(
            path,
            "/inference.GRPCInferenceService/ServerLive"
                | "/inference.GRPCInferenceService/ServerReady"
                | "/inference.GRPCInferenceService/ModelReady"
        )
}

/// Writes the access line of a call (target `celer::access`, as REST's).
pub fn log(line: CallLine<'_>) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let noted = line.note.0.lock().ok();
    let inference = noted.as_ref().and_then(|n| n.inference.clone());
    let trace_id = noted.as_ref().and_then(|n| n.trace_id.clone());
    let gone = noted.as_ref().is_some_and(|n| n.gone);
    drop(noted);
    let ending = match line.ending {
        Ending::Delivered(meant) if gone => Ending::Undelivered {
            meant: Some(meant),
            send_timeout: false,
        },
        ending => ending,
    };
    let (undelivered, cause) = match ending {
        Ending::Delivered(_) => (None, None),
        Ending::Undelivered {
            meant,
            send_timeout,
        } => (
            Some(meant.map_or("unknown", code_name)),
            Some(if send_timeout {
                "send_timeout"
            } else {
                "client_gone"
            }),
        ),
        Ending::Cancelled => (None, Some("cancelled_before_answer")),
    };
    let code = ending.code();
    macro_rules! access {
        ($level:ident) => {
            tracing::$level!(
                target: "celer::access",
                request_id = %line.request_id,
                method = "gRPC",
                path = %line.path,
                grpc_status = code_name(code),
                undelivered,
                cause,
                duration_ms = ms(line.took),
                device = inference.as_ref().map(|i| i.0.as_str()),
                queue_ms = inference.as_ref().map(|i| ms(i.1)),
                compute_ms = inference.as_ref().map(|i| ms(i.2)),
                trace_id = trace_id.as_deref().map(tracing::field::display),
                "request"
            )
        };
    }
    if code == Code::Ok && probe(line.path) {
        access!(debug);
    } else {
        access!(info);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_gets_ok_only_for_a_delivered_answer() {
        assert_eq!(Ending::Delivered(Code::Ok).code(), Code::Ok);
        assert_eq!(
            Ending::Delivered(Code::ResourceExhausted).code(),
            Code::ResourceExhausted
        );
        let undelivered = Ending::Undelivered {
            meant: Some(Code::Ok),
            send_timeout: true,
        };
        assert_eq!(undelivered.code(), Code::Cancelled);
        assert_eq!(Ending::Cancelled.code(), Code::Cancelled);
        assert!(probe("/grpc.health.v1.Health/Check"));
        assert!(!probe("/inference.GRPCInferenceService/ModelInfer"));
    }
}
