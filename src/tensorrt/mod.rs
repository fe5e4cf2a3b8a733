//! TensorRT's bindings and their safe layer, nothing more: building an engine from an ONNX
//! model and running one, through the C++ shim in `shim/` that opens libnvinfer at run time
//! (no link-time dependency on TensorRT). Layers, as in cudarc: `sys` (bindgen output) ->
//! `result` (status codes into `TrtError`) -> `runtime` / `builder` (owning, safe types).
//! Without the cargo feature `tensorrt`, `disabled` gives the same names, each returning
//! `TrtError::NotBuilt`; the shared vocabulary (`types`) is always built. celer's own
//! engines (manifests, the store, which engine a GPU serves from) are `crate::engines`;
//! nothing here knows images, pipelines or celer's files. See docs/architecture.md.

mod types;

pub use types::{
    BuildProgress, BuildSettings, BuiltEngine, CudaContextScope, CudaStream, DataType, DevicePtr,
    InputProfile, LibraryPaths, Precision, TensorDesc, TrtError, TrtParseError, TrtVersion,
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

// Compiled (and its test run) in every build, so that the build without the feature,
// which `make test` does not make, cannot rot unseen; exported only without the feature.
#[cfg_attr(feature = "tensorrt", allow(dead_code))]
mod disabled;
#[cfg(not(feature = "tensorrt"))]
pub use disabled::{Engine, ExecutionContext, Network, Runtime, TensorRt};

/// Whether this binary was built with the `tensorrt` feature.
pub const ENABLED: bool = cfg!(feature = "tensorrt");
