//! celer's TensorRT engines, as files and as a plan: the manifest written next to each
//! plan and the check that refuses a plan that does not fit (`manifest`), the shapes of
//! the optimisation profiles (`profile`), building one engine into its folder (`store`),
//! which engine each model of a GPU serves from (`select`), and, before the server
//! listens, the plan of every GPU with the engines it deserialises or builds (`plan`).
//! TensorRT itself is `crate::tensorrt`; this module knows the pipeline description and
//! the model directory, not pixels. See docs/architecture.md.

pub mod dirs;
pub mod manifest;
pub mod plan;
pub mod profile;
pub mod select;
pub mod store;
