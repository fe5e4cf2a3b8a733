//! The connection layer of `celer serve`: accepts TCP connections (at most
//! `max_connections` open at once) and serves HTTP/1.1 on each with hyper, under time
//! limits that a slow or idle client cannot stretch:
//!
//! - the request head must arrive within `header_timeout` (from the connection's start,
//!   or from the first byte of a later head), else the connection is closed;
//! - an idle keep-alive connection is closed after `keep_alive_timeout`;
//! - a response the client stops reading is given up after `send_timeout`;
//! - each request body is a `LimitedBody` (`body.rs`): whole-body and idle time limits
//!   (the handler answers 408), a shared memory budget, and a bounded drain of a body
//!   the handler answered without reading.
//!
//! When a connection ends with unread bytes possibly in flight (a body abandoned, a
//! malformed request hyper refused), the server half-closes it and reads and discards
//! what comes, bounded in bytes and time, before closing (a "lingering close"): closing a
//! socket with unread data sends a reset, and a reset can destroy the answer before the
//! client has read it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

use super::body::{BodyBudget, BodyOutcome, LimitedBody};
use crate::config::ConnLimits;

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish its request in progress (idle ones close at once) and returns when
/// all are closed. Bounding that wait is the caller's (the shutdown grace).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let permits = Arc::new(Semaphore::new(max));
    let budget = BodyBudget::new(limits.body_buffer_bytes);
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    let mut full_logged = false;
    loop {
        if permits.available_permits() == 0 && !full_logged {
            tracing::warn!(
                max_connections = max,
                "connection cap reached: new connections wait until one closes"
            );
            full_logged = true;
        }
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors, most likely: wait for some to close.
                tracing::error!(error = %e, "accept failed; retrying in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if permits.available_permits() > max / 2 {
            full_logged = false;
        }
        let _ = stream.set_nodelay(true);
        let (app, budget, stop) = (app.clone(), budget.clone(), stop_rx.clone());
        tokio::spawn(async move {
            connection(stream, app, limits, budget, stop).await;
            drop(permit);
        });
    }
    drop(listener);
    stop_tx.send_replace(true);
    // Every connection holds a permit until its socket is closed.
    let _all = permits.acquire_many(max as u32).await;
    Ok(())
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// What a connection is doing, as its supervisor sees it: times in ns since `start`,
/// 0 meaning "not now".
struct Activity {
    start: Instant,
    /// Requests in progress (from their head to their body's end or drain).
    busy: AtomicUsize,
    /// Requests answered so far.
    served: AtomicUsize,
    idle_since: AtomicU64,
    /// The first byte of a head read while idle.
    head_since: AtomicU64,
    /// A write that the client has not let finish since.
    write_stalled_since: AtomicU64,
    changed: Notify,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            start: Instant::now(),
            busy: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(0),
            write_stalled_since: AtomicU64::new(0),
            changed: Notify::new(),
        })
    }

    fn now(&self) -> u64 {
        (self.start.elapsed().as_nanos() as u64).max(1)
    }

    fn at(&self, ns: u64) -> Instant {
        self.start + Duration::from_nanos(ns)
    }

    /// When the supervisor must act next, and what it will do then.
    fn next_deadline(&self, limits: &ConnLimits) -> Option<(Instant, Expiry)> {
        let stalled = self.write_stalled_since.load(Ordering::Acquire);
        let write = (stalled != 0).then(|| (self.at(stalled) + limits.send_timeout, Expiry::Close));
        let read = if self.busy.load(Ordering::Acquire) > 0 {
            None
        } else {
            let head = self.head_since.load(Ordering::Acquire);
            if self.served.load(Ordering::Acquire) == 0 {
                Some((self.start + limits.header_timeout, Expiry::Close))
            } else if head != 0 {
                Some((self.at(head) + limits.header_timeout, Expiry::Close))
            } else {
                let idle = self.idle_since.load(Ordering::Acquire);
                Some((self.at(idle) + limits.keep_alive_timeout, Expiry::Idle))
            }
        };
        match (write, read) {
            (Some(w), Some(r)) => Some(if w.0 <= r.0 { w } else { r }),
            (w, r) => w.or(r),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    /// A head or a write overran its limit: close without further ado.
    Close,
    /// The keep-alive connection idled out: close it gracefully.
    Idle,
}

/// One request in progress on its connection, for as long as it is held.
struct Busy(Arc<Activity>);

impl Busy {
    fn new(activity: &Arc<Activity>) -> Self {
        activity.busy.fetch_add(1, Ordering::AcqRel);
        activity.head_since.store(0, Ordering::Release);
        activity.changed.notify_one();
        Self(activity.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let a = &self.0;
        if a.busy.fetch_sub(1, Ordering::AcqRel) == 1 {
            a.idle_since.store(a.now(), Ordering::Release);
            a.served.fetch_add(1, Ordering::AcqRel);
            a.changed.notify_one();
        }
    }
}

/// The socket, telling the supervisor when a head starts and when a write stalls.
struct Tracked {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        let a = &self.activity;
        if buf.filled().len() > before
            && a.busy.load(Ordering::Acquire) == 0
            && a.head_since.load(Ordering::Acquire) == 0
        {
            a.head_since.store(a.now(), Ordering::Release);
            a.changed.notify_one();
        }
        polled
    }
}

impl Tracked {
    fn note_write<T>(&self, polled: &Poll<std::io::Result<T>>) {
        let a = &self.activity;
        match polled {
            Poll::Pending => {
                if a.write_stalled_since.load(Ordering::Acquire) == 0 {
                    a.write_stalled_since.store(a.now(), Ordering::Release);
                    a.changed.notify_one();
                }
            }
            Poll::Ready(_) => a.write_stalled_since.store(0, Ordering::Release),
        }
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.note_write(&polled);
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.note_write(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.stream).poll_flush(cx);
        self.note_write(&polled);
        polled
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

type ServiceFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// How a connection ended.
enum Ended {
    /// hyper finished (the client closed, keep-alive ended, or hyper refused a request).
    Done { error: bool },
    /// A time limit ran out mid-head or mid-write.
    Expired,
}

async fn connection(
    stream: TcpStream,
    app: axum::Router,
    limits: ConnLimits,
    budget: Arc<BodyBudget>,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Activity::new();
    let outcome = Arc::new(BodyOutcome::default());
    let service = {
        let (activity, outcome) = (activity.clone(), outcome.clone());
        hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let (app, activity, outcome, budget) = (
                app.clone(),
                activity.clone(),
                outcome.clone(),
                budget.clone(),
            );
            Box::pin(async move {
                let busy = Busy::new(&activity);
                let (parts, body) = request.into_parts();
                let body_busy: Box<dyn Send + Sync> = Box::new(Busy::new(&activity));
                let body = LimitedBody::new(
                    body,
                    &parts.headers,
                    limits,
                    budget,
                    body_busy,
                    outcome.clone(),
                );
                let request = Request::from_parts(parts, axum::body::Body::new(body));
                let Ok(mut response) = app.oneshot(request).await;
                if outcome.abandoned() {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                drop(busy);
                Ok(response)
            }) as ServiceFuture
        })
    };
    let io = Tracked {
        stream,
        activity: activity.clone(),
    };
    let mut conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(io), service);
    let mut stopping = *stop.borrow();
    if stopping {
        Pin::new(&mut conn).graceful_shutdown();
    }
    let ended = loop {
        let deadline = activity.next_deadline(&limits);
        let wake = deadline.map_or_else(|| Instant::now() + Duration::from_secs(3600), |d| d.0);
        enum Event {
            Conn(hyper::Result<()>),
            Changed,
            Deadline,
            Stop,
        }
        let event = tokio::select! {
            r = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => Event::Conn(r),
            () = activity.changed.notified() => Event::Changed,
            () = tokio::time::sleep_until(wake) => Event::Deadline,
            r = stop.changed(), if !stopping => match r {
                Ok(()) => Event::Stop,
                Err(_) => Event::Stop,
            },
        };
        match event {
            Event::Conn(r) => break Ended::Done { error: r.is_err() },
            Event::Changed => {}
            Event::Stop => {
                stopping = true;
                Pin::new(&mut conn).graceful_shutdown();
            }
            Event::Deadline => match deadline {
                // Still due after a fresh look (a change may have raced the timer).
                Some((at, expiry)) if at <= Instant::now() => match expiry {
                    Expiry::Close => break Ended::Expired,
                    Expiry::Idle => {
                        if activity.head_since.load(Ordering::Acquire) == 0 {
                            Pin::new(&mut conn).graceful_shutdown();
                        }
                    }
                },
                _ => {}
            },
        }
    };
    match ended {
        Ended::Expired => drop(conn),
        Ended::Done { error } => {
            let parts = conn.into_parts();
            let stream = parts.io.into_inner().stream;
            if error || outcome.abandoned() {
                linger(stream, &limits).await;
            } else {
                let mut stream = stream;
                let _ = stream.shutdown().await;
            }
        }
    }
}

/// Half-closes `stream` (the client sees the end of the answer), then reads and
/// discards what the client still sends, up to `linger_bytes` and `linger`, and only
/// then closes: the client that was still sending its body can read the answer.
async fn linger(mut stream: TcpStream, limits: &ConnLimits) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let until = Instant::now() + limits.linger;
    let mut left = limits.linger_bytes;
    let mut buf = vec![0u8; 64 * 1024];
    while left > 0 {
        let gap = Instant::now() + limits.body_idle_timeout.min(limits.linger);
        match tokio::time::timeout_at(until.min(gap), stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n as u64),
            _ => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_fresh_connection_must_send_its_head_within_the_header_limit() {
        let limits = ConnLimits::default();
        let a = Activity::new();
        let (at, expiry) = a.next_deadline(&limits).unwrap();
        assert_eq!(expiry, Expiry::Close);
        assert_eq!(at, a.start + limits.header_timeout);
        // Busy: no read limit here (the body has its own).
        let busy = Busy::new(&a);
        assert!(a.next_deadline(&limits).is_none());
        drop(busy);
        // Idle after a request: the keep-alive limit.
        let (at, expiry) = a.next_deadline(&limits).unwrap();
        assert_eq!(expiry, Expiry::Idle);
        assert!(at > a.start + limits.keep_alive_timeout - Duration::from_secs(1));
        // A head started: the header limit again, from its first byte.
        a.head_since.store(a.now(), Ordering::Release);
        assert_eq!(a.next_deadline(&limits).unwrap().1, Expiry::Close);
        // A stalled write comes first when it is due first.
        a.write_stalled_since.store(1, Ordering::Release);
        let (at, expiry) = a.next_deadline(&limits).unwrap();
        assert_eq!(expiry, Expiry::Close);
        assert!(at <= a.start + limits.send_timeout + Duration::from_millis(1));
    }
}
