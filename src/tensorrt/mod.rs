//! TensorRT: building engines from ONNX models and running them, through the C++ shim in
//! `shim/` that opens libnvinfer at run time (no link-time dependency on TensorRT).
//! Layers, as in cudarc: `sys` (bindgen output) -> `result` (status codes into
//! `TrtError`) -> `runtime` / `builder` (owning, safe types). Without the cargo feature
//! `tensorrt`, `disabled` gives the same names, each returning `TrtError::NotBuilt`.
//! Always built: the shared vocabulary (`types`), engine manifests and their check
//! (`manifest`), optimisation-profile shapes (`profile`), building one engine into its
//! folder with its manifest (`store`), and which engine a GPU serves from (`select`).
//! GPUs are found by `crate::cuda::probe`. Nothing here knows images or the pipeline's
//! stages.

pub mod manifest;
pub mod profile;
pub mod select;
pub mod store;
mod types;

pub use types::{
    BuildProgress, BuildSettings, BuiltEngine, CudaStream, DataType, DevicePtr, InputProfile,
    LibraryPaths, Precision, TensorDesc, TrtError, TrtVersion,
};

#[cfg(feature = "tensorrt")]
mod builder;
#[cfg(feature = "tensorrt")]
mod result;
#[cfg(feature = "tensorrt")]
mod runtime;
#[cfg(feature = "tensorrt")]
mod sys;
#[cfg(feature = "tensorrt")]
pub use builder::Network;
#[cfg(feature = "tensorrt")]
pub use runtime::{Engine, ExecutionContext, Runtime, TensorRt};

#[cfg(not(feature = "tensorrt"))]
mod disabled;
#[cfg(not(feature = "tensorrt"))]
pub use disabled::{Engine, ExecutionContext, Network, Runtime, TensorRt};

/// Whether this binary was built with the `tensorrt` feature.
pub const ENABLED: bool = cfg!(feature = "tensorrt");
