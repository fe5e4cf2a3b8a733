//! Request bodies as the connection layer (`server`) hands them to the handlers: each is
//! wrapped in a `LimitedBody` that
//!
//! - ends with `BodyError::Timeout` when the whole body has not arrived within the body
//!   time limit, or no byte has arrived for the idle limit (the handler answers 408);
//! - counts its bytes against one budget shared by every connection, so that bodies in
//!   transit cannot take more memory than the operator allows (`BodyError::OverBudget`,
//!   answered 503);
//! - when a handler answers without reading it (413, 415, 503, ...) and drops it, reads
//!   and discards the rest in the background, bounded in bytes and time, so that the
//!   connection stays usable and a client that sends its whole body before reading the
//!   answer (Python's http.client, requests, aiohttp) reads that answer instead of a
//!   reset. A body it cannot drain (over the bounds, timed out, failed) is marked
//!   abandoned: the connection layer then answers with `Connection: close`. A client
//!   that sent `Expect: 100-continue` and is answered before its body was asked for is
//!   not asked for it at all: no `100 Continue`, and the connection closes after the
//!   answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{header, HeaderMap};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::config::ConnLimits;

/// Why a body could not be read to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the request body did not arrive within {limit_ms} ms ({what})")]
    Timeout { limit_ms: u64, what: &'static str },
    #[error("request bodies in transit already hold the server's {limit} bytes; retry later")]
    OverBudget { limit: usize },
}

/// The bytes of request bodies held at once, over every connection.
#[derive(Debug)]
pub struct BodyBudget {
    used: AtomicUsize,
    limit: usize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicUsize::new(0),
            limit: limit.max(1),
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// What the connection layer learns about its requests' bodies: one per connection.
#[derive(Debug, Default)]
pub struct BodyOutcome {
    abandoned: AtomicBool,
}

impl BodyOutcome {
    /// A body was neither read to its end nor drained: the connection cannot carry
    /// another request, and unread bytes may follow.
    pub fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }
}

/// A request body under the connection limits (see the module's header).
pub struct LimitedBody {
    /// `None` once handed to the drain task.
    inner: Option<Incoming>,
    limits: ConnLimits,
    budget: Arc<BodyBudget>,
    /// Bytes of this body counted in `budget`.
    held: usize,
    /// Bytes declared by `Content-Length`, if any.
    declared: Option<u64>,
    received: u64,
    deadline: Pin<Box<Sleep>>,
    idle: Pin<Box<Sleep>>,
    state: State,
    outcome: Arc<BodyOutcome>,
    /// Held while the body is being read or drained (the connection is busy).
    guard: Option<Box<dyn Send + Sync>>,
    /// The client sent `Expect: 100-continue` and the body has not been asked for yet:
    /// hyper sends `100 Continue` when it first is, and the client then uploads it.
    awaits_continue: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reading,
    Ended,
    Failed,
}

impl LimitedBody {
    /// `guard` is dropped once the body has ended or been drained or abandoned.
    pub fn new(
        inner: Incoming,
        headers: &HeaderMap,
        limits: ConnLimits,
        budget: Arc<BodyBudget>,
        guard: Box<dyn Send + Sync>,
        outcome: Arc<BodyOutcome>,
    ) -> Self {
        let now = Instant::now();
        let state = if inner.is_end_stream() {
            State::Ended
        } else {
            State::Reading
        };
        Self {
            inner: Some(inner),
            limits,
            budget,
            held: 0,
            declared: declared_length(headers),
            received: 0,
            deadline: Box::pin(tokio::time::sleep_until(now + limits.body_timeout)),
            idle: Box::pin(tokio::time::sleep_until(now + limits.body_idle_timeout)),
            state,
            outcome,
            guard: (state == State::Reading).then_some(guard),
            awaits_continue: expects_continue(headers),
        }
    }

    /// The body ends in `e` (a limit of ours, or the connection's own error), and the
    /// connection closes after the answer.
    fn fail(
        &mut self,
        e: impl Into<axum::BoxError>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        self.state = State::Failed;
        self.outcome.abandoned.store(true, Ordering::Release);
        Poll::Ready(Some(Err(e.into())))
    }
}

/// Whether the client waits for `100 Continue` before sending its body.
fn expects_continue(headers: &HeaderMap) -> bool {
    headers
        .get(header::EXPECT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"))
}

/// The `Content-Length` of a request, if it has a valid one.
pub fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.state != State::Reading {
            return Poll::Ready(None);
        }
        this.awaits_continue = false;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let n = data.len();
                    if !this.budget.take(n) {
                        let limit = this.budget.limit;
                        return this.fail(BodyError::OverBudget { limit });
                    }
                    this.held += n;
                    this.received += n as u64;
                    let next = Instant::now() + this.limits.body_idle_timeout;
                    this.idle.as_mut().reset(next);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => this.fail(e),
            Poll::Ready(None) => {
                this.state = State::Ended;
                this.guard = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let ms = |d: Duration| d.as_millis() as u64;
                if this.deadline.as_mut().poll(cx).is_ready() {
                    let limit_ms = ms(this.limits.body_timeout);
                    return this.fail(BodyError::Timeout {
                        limit_ms,
                        what: "the whole body's limit",
                    });
                }
                if this.idle.as_mut().poll(cx).is_ready() {
                    let limit_ms = ms(this.limits.body_idle_timeout);
                    return this.fail(BodyError::Timeout {
                        limit_ms,
                        what: "no byte arrived for the idle limit",
                    });
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state != State::Reading || self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, self.state) {
            (Some(b), State::Reading) => b.size_hint(),
            _ => SizeHint::with_exact(0),
        }
    }
}

impl Drop for LimitedBody {
    fn drop(&mut self) {
        self.budget.give(self.held);
        self.held = 0;
        if self.state != State::Reading {
            return;
        }
        // Dropped before its end: the handler answered without reading it all. A client
        // still waiting for `100 Continue` is not asked for the body it would only send to
        // be discarded: the answer closes the connection instead (hyper stops reading).
        if self.awaits_continue {
            self.outcome.abandoned.store(true, Ordering::Release);
            return;
        }
        let left = self.declared.map(|d| d.saturating_sub(self.received));
        let fits = left.is_none_or(|left| left <= self.limits.linger_bytes);
        let runtime = tokio::runtime::Handle::try_current();
        match (self.inner.take(), fits, runtime) {
            (Some(inner), true, Ok(runtime)) if !self.limits.linger.is_zero() => {
                let guard = self.guard.take();
                let outcome = self.outcome.clone();
                let limits = self.limits;
                runtime.spawn(drain(inner, limits, outcome, guard));
            }
            _ => self.outcome.abandoned.store(true, Ordering::Release),
        }
    }
}

/// Reads and discards the rest of a body the handler did not want, within the linger
/// bounds; a body that goes over them is abandoned (dropping it makes the connection
/// close after the answer).
async fn drain(
    mut body: Incoming,
    limits: ConnLimits,
    outcome: Arc<BodyOutcome>,
    guard: Option<Box<dyn Send + Sync>>,
) {
    let started = Instant::now();
    let mut left = limits.linger_bytes;
    let finished = loop {
        let next = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx));
        let gap = limits.body_idle_timeout.min(limits.linger);
        let by = (started + limits.linger).min(Instant::now() + gap);
        match tokio::time::timeout_at(by, next).await {
            Ok(None) => break true,
            Ok(Some(Ok(frame))) => {
                let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                match left.checked_sub(n) {
                    Some(rest) => left = rest,
                    None => break false,
                }
            }
            Ok(Some(Err(_))) | Err(_) => break false,
        }
    };
    if !finished {
        outcome.abandoned.store(true, Ordering::Release);
    }
    drop(guard);
}
