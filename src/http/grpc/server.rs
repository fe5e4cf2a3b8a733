//! The gRPC listener: tonic's HTTP/2 server on its own port, under limits that mirror the
//! REST side's (`http::server`), so that a slow, stalled or flooding client holds nothing
//! others need:
//!
//! - at most `max_connections` open at once (beyond, the kernel's backlog holds new ones);
//!   at most `streams_per_connection` streams open on each (HTTP/2's
//!   SETTINGS_MAX_CONCURRENT_STREAMS: h2 refuses one more with REFUSED_STREAM);
//! - a received message over `max_message_bytes` (the hosting mode's body limit) is
//!   refused by tonic before it is held whole (`OUT_OF_RANGE`);
//! - calls in transit (from their head until their answer is delivered) are capped
//!   server-wide, so that messages held in memory stay within the bodies' memory budget,
//!   and each connection has a share of the cap (`transit_per_connection`): beyond either
//!   a call is refused at once with `RESOURCE_EXHAUSTED`, never queued (`transit.rs`);
//! - a message must keep arriving: the REST body timers, per stream (`DEADLINE_EXCEEDED`);
//! - an answer must be read within the send timeout, or its connection is ended;
//! - every call is answered within `request_timeout` (tonic's own timeout, which also
//!   applies the client's `grpc-timeout`): it never held an inference slot while its
//!   message arrived (admission comes once its message is whole);
//! - HTTP/2 keep-alive pings find dead peers, so their connections do not linger; a
//!   client that makes the server reset streams (malformed frames) past
//!   `LOCAL_RESETS_PER_CONNECTION` is sent GOAWAY (CVE-2025-8671, "MadeYouReset").

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::conn::accept_capped;
use super::health::HealthService;
use super::service::InferenceService;
use super::transit::{CallLimits, TransitLayer, HEALTH_MESSAGE_BYTES};
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
    /// ... and on one connection.
    pub transit_per_connection: usize,
    /// Concurrent streams a client may open on one connection.
    pub streams_per_connection: u32,
    /// The time limits of each call: its message's, its answer's and its whole time.
    pub calls: CallLimits,
    pub keep_alive_interval: Duration,
}

/// Streams the server may reset for a client's errors (malformed frames, streams past
/// the concurrency limit) on one connection before it sends GOAWAY: hyper's own default,
/// which tonic turns off.
const LOCAL_RESETS_PER_CONNECTION: usize = 1024;

impl GrpcLimits {
    /// The REST side's limits, as they apply to gRPC: its connection cap; its body limit
    /// as the message limit; as many messages in transit as the bodies' memory budget
    /// holds (and at least twice the admission limit, so that the cap never refuses what
    /// admission would take); its body and send timeouts per call; the request deadline
    /// plus the whole-body time per call.
    ///
    /// A connection's share of the calls in transit is what admission takes at once
    /// (at most half the cap): one client multiplexing its calls on one connection can
    /// still fill every inference slot, as it could with as many HTTP/1.1 connections,
    /// and one connection, however it stalls its streams, leaves at least half of the
    /// cap to the others.
    pub fn from_rest(
        conn: &crate::config::ConnLimits,
        requests: &crate::config::RequestLimits,
        admission_limit: usize,
    ) -> Self {
        let max_message_bytes = requests.max_body_bytes.max(1);
        let max_in_transit = (conn.body_buffer_bytes / max_message_bytes)
            .max(2 * admission_limit)
            .max(1);
        Self {
            max_connections: conn.max_connections.max(1),
            max_message_bytes,
            max_in_transit,
            transit_per_connection: admission_limit.min(max_in_transit / 2).max(1),
            streams_per_connection: 128,
            calls: CallLimits {
                body_timeout: conn.body_timeout,
                body_idle_timeout: conn.body_idle_timeout,
                send_timeout: conn.send_timeout,
                request_timeout: requests.deadline + conn.body_timeout,
            },
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
    // Health's calls take no place in transit (`transit.rs`): their messages are kept small.
    let health = HealthServer::new(HealthService { state, stopping })
        .max_decoding_message_size(HEALTH_MESSAGE_BYTES);
    let connections = accept_capped(
        listener,
        limits.max_connections,
        limits.transit_per_connection,
    );
    let shutdown = async move {
        shutdown.await;
        stopping_tx.send_replace(true);
    };
    let mut server = tonic::transport::Server::builder()
        .timeout(limits.calls.request_timeout)
        .max_concurrent_streams(limits.streams_per_connection)
        .http2_max_local_error_reset_streams(Some(LOCAL_RESETS_PER_CONNECTION))
        .http2_keepalive_interval(Some(limits.keep_alive_interval))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .layer(TransitLayer {
            permits: Arc::new(Semaphore::new(
                limits.max_in_transit.clamp(1, Semaphore::MAX_PERMITS),
            )),
            limits: limits.calls,
        });
    server
        .add_service(inference)
        .add_service(health)
        .serve_with_incoming_shutdown(connections, shutdown)
        .await
        .map_err(io::Error::other)
}
