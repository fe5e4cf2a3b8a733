//! gRPC's standard health service (`grpc.health.v1.Health`), which Kubernetes' gRPC
//! probes and `grpc_health_probe` call. The server as a whole (`""`) and the inference
//! service (`inference.GRPCInferenceService`) are SERVING when `/v2/health/ready` would
//! answer 200 (replicas loaded, a device healthy, not draining), else NOT_SERVING. The
//! status is read when asked, never pushed, so it cannot go stale.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::http::v2::readiness;
use crate::http::AppState;
use crate::oip::health::health_check_response::ServingStatus;
use crate::oip::health::health_server::Health;
use crate::oip::health::{HealthCheckRequest, HealthCheckResponse};

/// The services a health check may name.
const SERVICES: [&str; 2] = ["", "inference.GRPCInferenceService"];

/// How often `Watch` looks at readiness to send a change.
const WATCH_EVERY: Duration = Duration::from_millis(250);

pub struct HealthService {
    pub state: Arc<AppState>,
    /// Turns true when the server stops: open `Watch` streams end (NOT_SERVING), so that
    /// they do not hold the shutdown to its grace period.
    pub stopping: tokio::sync::watch::Receiver<bool>,
}

fn status_now(state: &AppState) -> ServingStatus {
    if readiness(state).1 {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

fn response(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status.into(),
    }
}

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = &request.get_ref().service;
        if !SERVICES.contains(&service.as_str()) {
            // The protocol's answer for a service the server does not know.
            return Err(Status::not_found(format!(
                "no service `{service}`; health is kept for \"\" and inference.GRPCInferenceService"
            )));
        }
        Ok(Response::new(response(status_now(&self.state))))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    /// The status now, then each change, until the client goes away. An unknown service
    /// is SERVICE_UNKNOWN, as the protocol says (not an error: it may appear later).
    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let known = SERVICES.contains(&request.get_ref().service.as_str());
        let state = self.state.clone();
        let mut stopping = self.stopping.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            let mut last = None;
            loop {
                if *stopping.borrow() {
                    let _ = tx.send(Ok(response(ServingStatus::NotServing))).await;
                    return;
                }
                let now = if known {
                    status_now(&state)
                } else {
                    ServingStatus::ServiceUnknown
                };
                if last != Some(now) {
                    if tx.send(Ok(response(now))).await.is_err() {
                        return;
                    }
                    last = Some(now);
                }
                tokio::select! {
                    () = tokio::time::sleep(WATCH_EVERY) => {}
                    () = tx.closed() => return,
                    changed = stopping.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
