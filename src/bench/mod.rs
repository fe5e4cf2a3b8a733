//! Latency benchmarking: load against a running server (`http`), in-process stage timing
//! and the model-only limit (`local`), and the reports both produce (`report`).

pub mod cpu;
pub mod http;
pub mod local;
pub mod report;
