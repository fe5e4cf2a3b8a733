//! The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`: health,
//! metadata, Triton's model configuration and `ModelInfer`) and gRPC's standard health
//! service (`grpc.health.v1`), served by tonic on a port of their own (`--grpc-port`,
//! 8001 as Triton's). Same model, tensors and request path as the REST routes (`v2.rs`):
//! one admission, deadline, set of limits and metrics for every protocol. Refusals are
//! gRPC statuses (`status.rs`); the listener's limits are in `server.rs`.

mod health;
mod infer;
mod server;
mod service;
mod status;

pub use server::{serve, GrpcLimits};

/// The messages and service generated from `proto/grpc_service.proto` (build.rs).
#[allow(clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("inference");
}

/// gRPC's health service, generated from `proto/health.proto`.
#[allow(clippy::all, clippy::pedantic)]
pub mod health_proto {
    tonic::include_proto!("grpc.health.v1");
}
