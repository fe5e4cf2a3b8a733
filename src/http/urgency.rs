//! A request's priority and deadline as its client gives them: in SageMaker's custom
//! attributes (`priority=`, `deadline-ms=`; the one header SageMaker passes through) or in
//! the Open Inference Protocol's request parameters (`priority`; `timeout` in microseconds,
//! as Triton reads it, or `deadline_ms`). The sooner of the client's deadline and the
//! server's is the request's; the scheduler orders and refuses by them.

use std::time::{Duration, Instant};

use axum::http::HeaderMap;

use super::error::ApiError;
use super::negotiate::custom_attribute;
use crate::sched::{Priority, Terms};

/// What a client asked, before it becomes a request's terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Asked {
    pub priority: Option<u64>,
    /// How long the client waits from its request's arrival.
    pub within: Option<Duration>,
}

impl Asked {
    /// `priority=` and `deadline-ms=` in `X-Amzn-SageMaker-Custom-Attributes`.
    pub fn from_custom_attributes(headers: &HeaderMap) -> Result<Self, ApiError> {
        let bad = |what: String| ApiError::bad_request("bad_custom_attribute", what);
        let number = |key: &str| -> Result<Option<u64>, ApiError> {
            custom_attribute(headers, key)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| bad(format!("{key}={v}: expected a whole number")))
                })
                .transpose()
        };
        Ok(Self {
            priority: number("priority")?,
            within: number("deadline-ms")?.map(Duration::from_millis),
        })
    }

    /// The terms of a request that arrived at `arrived`, on a server whose own deadline
    /// is `server` after arrival.
    pub fn terms(self, arrived: Instant, server: Duration) -> Result<Terms, ApiError> {
        let priority = match self.priority {
            None => Priority::DEFAULT,
            Some(level) => Priority::from_level(level)
                .map_err(|e| ApiError::bad_request("bad_priority", e.to_string()))?,
        };
        if self.within == Some(Duration::ZERO) {
            return Err(ApiError::bad_request(
                "bad_deadline",
                "a deadline of 0 ms cannot be met; give a positive deadline, or none",
            ));
        }
        let within = self.within.map_or(server, |w| w.min(server));
        Ok(Terms::by(arrived + within)
            .with_server_deadline(arrived + server)
            .with_priority(priority))
    }
}

/// The sooner of two deadlines, either of which may be missing.
pub fn sooner(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn asked(attributes: &str) -> Result<Asked, ApiError> {
        let mut headers = HeaderMap::new();
        headers.insert(
            super::super::negotiate::CUSTOM_ATTRIBUTES,
            HeaderValue::from_str(attributes).expect("ascii"),
        );
        Asked::from_custom_attributes(&headers)
    }

    #[test]
    fn custom_attributes_carry_priority_and_deadline() {
        let server = Duration::from_secs(60);
        let now = Instant::now();
        let terms = asked("output=alpha;priority=1;deadline-ms=250")
            .and_then(|a| a.terms(now, server))
            .expect("valid");
        assert_eq!(terms.priority, Priority::HIGHEST);
        assert_eq!(terms.deadline, now + Duration::from_millis(250));
        // The server's deadline bounds the client's.
        let late = asked("deadline-ms=600000")
            .and_then(|a| a.terms(now, server))
            .expect("valid");
        assert_eq!(late.deadline, now + server);
        assert_eq!(late.priority, Priority::DEFAULT);
    }

    #[test]
    fn wrong_values_are_the_clients_mistake() {
        let now = Instant::now();
        let server = Duration::from_secs(60);
        for wrong in [
            "priority=high",
            "priority=12",
            "deadline-ms=-5",
            "deadline-ms=0",
        ] {
            let e = asked(wrong)
                .and_then(|a| a.terms(now, server))
                .expect_err(wrong);
            assert_eq!(e.status.as_u16(), 400, "{wrong}");
        }
    }
}
