//! The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`: health,
//! metadata, Triton's model configuration and `ModelInfer`) and gRPC's standard health
//! service (`grpc.health.v1`), served by tonic on a port of their own (`--grpc-port`,
//! 8001 as Triton's). Same model, tensors and request path as the REST routes (`v2.rs`):
//! one admission, deadline, set of limits and metrics for every protocol. Refusals are
//! gRPC statuses (`status.rs`); the listener's limits are in `server.rs`, a call's in
//! `transit.rs`, each call's access line in `access.rs`. The messages
//! and service traits are generated (`oip`).

mod access;
mod conn;
mod health;
mod infer;
mod server;
mod service;
mod status;
mod transit;

pub use server::{serve, GrpcLimits};
pub use transit::CallLimits;
