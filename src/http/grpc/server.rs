//! The gRPC listener: tonic's HTTP/2 server on its own port, under limits that mirror the
//! REST side's (`http::server`), so that a slow, stalled or flooding client holds nothing
//! others need:
//!
//! - at most `max_connections` open at once (beyond, the kernel's backlog holds new ones);
//! - a received message over `max_message_bytes` (the hosting mode's body limit) is
//!   refused by tonic before it is held whole (`OUT_OF_RANGE`);
//! - requests in transit (being received or answered) are capped server-wide, so that
//!   messages held in memory stay within the bodies' memory budget: beyond the cap a call
//!   is refused at once with `RESOURCE_EXHAUSTED`, never queued;
//! - every call ends within `request_timeout` (tonic's own timeout, which also applies
//!   the client's `grpc-timeout`): a stalled stream is ended, and it never held an
//!   inference slot (admission comes once its message is whole);
//! - HTTP/2 keep-alive pings find dead peers, so their connections do not linger.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{Request, Response};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::Status;
use tower::{Layer, Service};

use super::health::HealthService;
use super::service::{Arrived, InferenceService};
use crate::http::AppState;
use crate::oip::health::health_server::HealthServer;
use crate::oip::inference::grpc_inference_service_server::GrpcInferenceServiceServer;

/// The gRPC listener's limits.
#[derive(Debug, Clone, Copy)]
pub struct GrpcLimits {
    pub max_connections: usize,
    /// Largest received message (the hosting mode's body limit).
    pub max_message_bytes: usize,
    /// Calls received or being answered at once, server-wide.
    pub max_in_transit: usize,
    /// Concurrent streams a client may open on one connection.
    pub streams_per_connection: u32,
    /// A call's whole time, from its head to its answer.
    pub request_timeout: Duration,
    pub keep_alive_interval: Duration,
}

impl GrpcLimits {
    /// The REST side's limits, as they apply to gRPC: its connection cap; its body limit
    /// as the message limit; as many messages in transit as the bodies' memory budget
    /// holds (and at least twice the admission limit, so that the cap never refuses what
    /// admission would take); the request deadline plus the whole-body time per call.
    pub fn from_rest(
        conn: &crate::config::ConnLimits,
        requests: &crate::config::RequestLimits,
        admission_limit: usize,
    ) -> Self {
        let max_message_bytes = requests.max_body_bytes.max(1);
        Self {
            max_connections: conn.max_connections.max(1),
            max_message_bytes,
            max_in_transit: (conn.body_buffer_bytes / max_message_bytes)
                .max(2 * admission_limit)
                .max(1),
            streams_per_connection: 128,
            request_timeout: requests.deadline + conn.body_timeout,
            keep_alive_interval: Duration::from_secs(30),
        }
    }
}

/// Serves the Open Inference Protocol's gRPC service and gRPC health on `listener` until
/// `shutdown` resolves; then stops accepting, answers the calls in progress and returns
/// (bounding that wait is the caller's, as for REST).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    limits: GrpcLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    let inference = GrpcInferenceServiceServer::new(InferenceService {
        state: state.clone(),
    })
    .max_decoding_message_size(limits.max_message_bytes)
    // The answer's size is checked against the hosting mode's limit before it is sent
    // (`infer.rs`), with a message saying what to ask for instead.
    .max_encoding_message_size(usize::MAX);
    let health = HealthServer::new(HealthService { state, stopping });
    let connections = accept_capped(listener, limits.max_connections);
    let shutdown = async move {
        shutdown.await;
        stopping_tx.send_replace(true);
    };
    let mut server = tonic::transport::Server::builder()
        .timeout(limits.request_timeout)
        .max_concurrent_streams(limits.streams_per_connection)
        .http2_keepalive_interval(Some(limits.keep_alive_interval))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .layer(InTransitLayer {
            permits: Arc::new(Semaphore::new(
                limits.max_in_transit.clamp(1, Semaphore::MAX_PERMITS),
            )),
        });
    server
        .add_service(inference)
        .add_service(health)
        .serve_with_incoming_shutdown(connections, shutdown)
        .await
        .map_err(io::Error::other)
}

/// The accepted connections as tonic takes them, at most `max` open at once: each holds
/// a permit until its socket is dropped.
fn accept_capped(listener: TcpListener, max: usize) -> ReceiverStream<io::Result<Capped>> {
    let permits = Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS)));
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
                () = tx.closed() => return,
            };
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let capped = Capped {
                        stream,
                        _permit: permit,
                    };
                    if tx.send(Ok(capped)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    // A reset before accept, or out of file descriptors: wait a little
                    // (the permit goes back) rather than spin.
                    tracing::warn!(error = %e, "gRPC accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// A connection holding its place under the connection cap.
struct Capped {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl Connected for Capped {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Capped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Capped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The server-wide cap on calls in transit (see the module's header).
#[derive(Clone)]
struct InTransitLayer {
    permits: Arc<Semaphore>,
}

impl<S> Layer<S> for InTransitLayer {
    type Service = InTransit<S>;

    fn layer(&self, inner: S) -> InTransit<S> {
        InTransit {
            inner,
            permits: self.permits.clone(),
        }
    }
}

#[derive(Clone)]
struct InTransit<S> {
    inner: S,
    permits: Arc<Semaphore>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> Service<Request<B>> for InTransit<S>
where
    S: Service<Request<B>, Response = Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        request
            .extensions_mut()
            .insert(Arrived(std::time::Instant::now()));
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let call = self.inner.call(request);
                Box::pin(async move {
                    let answer = call.await;
                    drop(permit);
                    answer
                })
            }
            Err(_) => Box::pin(async {
                let mut status = Status::resource_exhausted(
                    "the server holds as many calls in transit as its memory for request \
                     bodies allows; retry later (overloaded)",
                );
                status
                    .metadata_mut()
                    .insert("grpc-retry-pushback-ms", 1000u64.into());
                Ok(status.into_http())
            }),
        }
    }
}
