//! Calls in transit on the gRPC listener (a tower layer around every service): from a
//! call's head until its answer is delivered it holds a place in the server-wide cap and
//! one in its connection's share (gRPC health's small calls excepted); its message must keep arriving (the body timers of
//! REST's uploads, per stream); its answer must be read within the send timeout, or its
//! connection is ended, which frees what hyper held of it. Each call's access line is
//! written when it ends for its client (`access.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, Request, Response};
use bytes::Bytes;
use http_body::{Body as _, Frame, SizeHint};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tonic::body::Body;
use tonic::{Code, Status};
use tower::{Layer, Service};

use super::access::{self, CallLine, CallNote, Ending};
use super::conn::Conn;
use super::service::Arrived;
use super::status::status_of;
use crate::http::access::{request_id, RequestId};
use crate::http::body::BodyError;
use crate::http::error::ApiError;

/// The time limits a call runs under.
#[derive(Debug, Clone, Copy)]
pub struct CallLimits {
    /// The whole message, from the call's head.
    pub body_timeout: Duration,
    /// Between two frames of the message.
    pub body_idle_timeout: Duration,
    /// To deliver an answer once it is ready.
    pub send_timeout: Duration,
    /// The call's whole time (tonic's own timer ends a call still unanswered then).
    pub request_timeout: Duration,
}

/// The least time an answer is given to be read, even when the call's time is nearly
/// out: a refusal made at the last moment still reaches a client that reads.
const LEAST_SEND_TIME: Duration = Duration::from_secs(1);

/// The largest message of gRPC health's calls (a service's name).
pub const HEALTH_MESSAGE_BYTES: usize = 1024;

/// gRPC health's calls: their messages are small (`HEALTH_MESSAGE_BYTES`), so they take
/// no place in transit and are never refused for overload: a probe is answered however
/// busy the server is.
fn is_health(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/")
}

/// Calls whose answer is a stream that lasts as long as the client wants (health's
/// Watch): no send timer applies to them.
fn streams_answers(path: &str) -> bool {
    path == "/grpc.health.v1.Health/Watch"
}

#[derive(Clone)]
pub struct TransitLayer {
    pub permits: Arc<Semaphore>,
    pub limits: CallLimits,
}

impl<S> Layer<S> for TransitLayer {
    type Service = Transit<S>;

    fn layer(&self, inner: S) -> Transit<S> {
        Transit {
            inner,
            permits: self.permits.clone(),
            limits: self.limits,
        }
    }
}

#[derive(Clone)]
pub struct Transit<S> {
    inner: S,
    permits: Arc<Semaphore>,
    limits: CallLimits,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> Service<Request<Body>> for Transit<S>
where
    S: Service<Request<Body>, Response = Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        let arrived = Instant::now();
        let id = request_id(request.headers());
        let note = CallNote::default();
        let conn = request.extensions().get::<Conn>().cloned();
        let mut call = CallEnd {
            request_id: id.clone(),
            path: request.uri().path().to_string(),
            arrived,
            note: note.clone(),
            conn,
            places: None,
            ending: Ending::Cancelled,
        };
        let limits = self.limits;
        if !is_health(&call.path) {
            match call.take_places(&self.permits) {
                Ok(places) => call.places = Some(places),
                Err(refusal) => {
                    let response = status_of(&refusal).into_http();
                    return Box::pin(async move { Ok(answer(response, call, limits)) });
                }
            }
        }
        let extensions = request.extensions_mut();
        extensions.insert(Arrived(arrived));
        extensions.insert(RequestId(id));
        extensions.insert(note.clone());
        let request = request.map(|body| Body::new(TimedBody::new(body, arrived, &limits, note)));
        let pending = self.inner.call(request);
        Box::pin(async move {
            // Dropped here (the client reset the stream, or tonic's timer ended the
            // call), `call` writes its line as cancelled.
            let response = pending.await?;
            Ok(answer(response, call, limits))
        })
    }
}

/// A call until it ends for its client: its places in transit, and what its access line
/// needs. Dropped, it gives its places back and writes the line.
struct CallEnd {
    request_id: String,
    path: String,
    arrived: Instant,
    note: CallNote,
    conn: Option<Conn>,
    /// In the connection's share (where the connection has one), and in the server's cap.
    places: Option<(Option<OwnedSemaphorePermit>, OwnedSemaphorePermit)>,
    ending: Ending,
}

impl CallEnd {
    /// A place in the connection's share, then one in the server's cap; refused
    /// (`RESOURCE_EXHAUSTED`, `overloaded`, with a retry hint) where either is full.
    fn take_places(
        &self,
        server: &Arc<Semaphore>,
    ) -> Result<(Option<OwnedSemaphorePermit>, OwnedSemaphorePermit), ApiError> {
        let overloaded = |message: &str| ApiError {
            retry_after_s: Some(1),
            ..ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                message.to_string(),
            )
        };
        // Every connection comes through `accept_capped` with its share; were one not
        // to, the server's cap would still hold.
        let own = match &self.conn {
            Some(conn) => Some(conn.try_transit().ok_or_else(|| {
                overloaded(
                    "this connection holds its share of the server's calls in transit; \
                     retry later or on another connection",
                )
            })?),
            None => None,
        };
        let shared = server.clone().try_acquire_owned().map_err(|_| {
            overloaded(
                "the server holds as many calls in transit as its memory for request \
                 bodies allows; retry later",
            )
        })?;
        Ok((own, shared))
    }
}

impl Drop for CallEnd {
    fn drop(&mut self) {
        self.places = None;
        access::log(CallLine {
            request_id: &self.request_id,
            path: &self.path,
            ending: self.ending,
            took: self.arrived.elapsed(),
            note: &self.note,
        });
    }
}

/// The call's answer as hyper sends it: the call ends with its last frame. Unless the
/// answer is a status alone (no data to wait for), a send timer is set: an answer not
/// delivered within the send timeout (and the call's time) ends its connection.
fn answer(response: Response<Body>, call: CallEnd, limits: CallLimits) -> Response<Body> {
    let (parts, body) = response.into_parts();
    let header_code = code_in(&parts.headers);
    let mut watchdog = None;
    if !streams_answers(&call.path) && !body.is_end_stream() {
        if let Some(conn) = call.conn.clone() {
            let ready = Instant::now();
            let by = (ready + limits.send_timeout)
                .min(call.arrived + limits.request_timeout)
                .max(ready + LEAST_SEND_TIME);
            watchdog = Some(watch_send(conn, by));
        }
    }
    let answer = Answer {
        inner: body,
        header_code,
        call: Some(call),
        watchdog,
    };
    Response::from_parts(parts, Body::new(answer))
}

/// Ends `conn` at `by` unless the returned sender is dropped first (the answer ended).
fn watch_send(conn: Conn, by: Instant) -> oneshot::Sender<()> {
    let (delivered, mut watch) = oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            () = tokio::time::sleep_until(by.into()) => {
                tracing::info!(
                    remote = conn.remote().map(tracing::field::display),
                    "gRPC connection ended: an answer was not read within the send timeout"
                );
                conn.kill();
            }
            _ = &mut watch => {}
        }
    });
    delivered
}

/// The gRPC status in a header map (trailers, or the head of a status-only answer).
fn code_in(headers: &HeaderMap) -> Option<Code> {
    Status::from_header_map(headers).map(|s| s.code())
}

/// A call's answer body: its trailers (or its end) mark the call delivered.
struct Answer {
    inner: Body,
    header_code: Option<Code>,
    call: Option<CallEnd>,
    /// The send timer's: dropped when the answer ends, which stops the timer.
    watchdog: Option<oneshot::Sender<()>>,
}

impl Answer {
    fn end(&mut self, ending: Ending) {
        if let Some(mut call) = self.call.take() {
            call.ending = ending;
        }
        self.watchdog = None;
    }
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(trailers) = f.trailers_ref() {
                    let code = code_in(trailers).unwrap_or(Code::Unknown);
                    self.end(Ending::Delivered(code));
                }
            }
            None => {
                let code = self.header_code.unwrap_or(Code::Ok);
                self.end(Ending::Delivered(code));
            }
            Some(Err(e)) => {
                let meant = Some(e.code());
                self.end(Ending::Undelivered {
                    meant,
                    send_timeout: false,
                });
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if self.call.is_none() {
            return;
        }
        // A status alone is sent whole with the head (hyper sends it without polling
        // the body); anything else dropped before its end was not delivered.
        let ending = if self.inner.is_end_stream() {
            Ending::Delivered(self.header_code.unwrap_or(Code::Ok))
        } else {
            let send_timeout = self
                .call
                .as_ref()
                .and_then(|c| c.conn.as_ref())
                .is_some_and(Conn::killed);
            let meant = self.call.as_ref().and_then(|c| c.note.code());
            Ending::Undelivered {
                meant,
                send_timeout,
            }
        };
        self.end(ending);
    }
}

/// A call's message as the handler reads it: ended with `DEADLINE_EXCEEDED`
/// (`body_timeout`) when it has not arrived whole within the body's time limit from the
/// call's head, or when no frame has arrived for the idle limit.
struct TimedBody {
    inner: Body,
    whole_by: Instant,
    idle: Duration,
    limits: CallLimits,
    timer: Pin<Box<Sleep>>,
    ended: bool,
    note: CallNote,
}

impl TimedBody {
    fn new(inner: Body, arrived: Instant, limits: &CallLimits, note: CallNote) -> Self {
        let whole_by = arrived + limits.body_timeout;
        let first = (arrived + limits.body_idle_timeout).min(whole_by);
        Self {
            inner,
            whole_by,
            idle: limits.body_idle_timeout,
            limits: *limits,
            timer: Box::pin(tokio::time::sleep_until(first.into())),
            ended: false,
            note,
        }
    }

    fn timed_out(&mut self) -> Status {
        self.ended = true;
        let ms = |d: Duration| d.as_millis() as u64;
        let error = if Instant::now() >= self.whole_by {
            BodyError::Timeout {
                limit_ms: ms(self.limits.body_timeout),
                what: "the whole message's limit",
            }
        } else {
            BodyError::Timeout {
                limit_ms: ms(self.idle),
                what: "no frame arrived for the idle limit",
            }
        };
        status_of(&ApiError::from(error))
    }
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let next = (Instant::now() + this.idle).min(this.whole_by);
                this.timer.as_mut().reset(next.into());
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.ended = true;
                Poll::Ready(None)
            }
            // The client reset the stream, or its connection failed: whatever the
            // handler answers, the client cancelled the call.
            Poll::Ready(Some(Err(e))) => {
                this.ended = true;
                this.note.client_gone();
                Poll::Ready(Some(Err(e)))
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(this.timed_out()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
