//! The GPU as celer computes on it: celer's own layer over the CUDA driver API (`driver`:
//! every entry point with a raw integer result, so that a code newer than any bindings is
//! never undefined behaviour; `DriverError`; the safe handles; counters of what celer asks
//! of the driver), the probe (which GPUs, what they are), one GPU's context and kernels
//! (`device`), NVRTC and the kernels (`kernels/*.cu`, compiled at start-up for each GPU's
//! architecture), their typed launchers (`launch`, `taps`), the fast guided filter's
//! buffers and steps (`guided`), model tensors on the device (`tensor`) and a TensorRT
//! engine with its own buffers (`trt_model`) and what TensorRT needs of the GPU's context
//! (`trt_context`). How a replica orders these for a request is
//! `crate::replica::gpu`. The CPU stages in `crate::stages` are the reference every kernel
//! is tested against. Nothing here may panic on a machine without a GPU: the probe comes
//! first and says "no CUDA driver". `unsafe` lives here (FFI, launches, the TensorRT
//! model), each block with its reason.

pub mod arch;
pub mod device;
pub mod driver;
pub mod guided;
pub mod host_pool;
pub mod kernels;
pub mod launch;
pub mod nvrtc;
pub mod plane_resize;
pub mod probe;
pub mod taps;
pub mod tensor;
pub mod trt_context;
pub mod trt_model;

pub use arch::{Arch, UnknownArch};
pub use device::{pinned, GpuDevice};
pub use host_pool::HostPool;
pub use probe::{probe, CudaVersion, GpuIdentity, GpuInfo, Probe, DRIVER_FLOOR};

/// An image's or plane's `(width, height)` in pixels.
pub type Size = (u32, u32);

/// A failure in the CUDA path: the driver, NVRTC, the kernels and their buffers. The
/// server's fault, never the client's: the caller falls back to, or stays on, the CPU
/// path. ONNX Runtime's and TensorRT's errors are not CUDA's: a TensorRT model says its
/// own (`trt_model::TrtModelError`), a GPU replica carries all three (`GpuError`).
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver (libcuda.so) on this machine")]
    NoDriver,
    /// The driver is older than `probe::DRIVER_FLOOR`: its GPUs are not used.
    #[error("{}", probe::below_floor(*.0))]
    BelowFloor(CudaVersion),
    /// A driver call failed; `context` says what celer was doing when it matters.
    #[error("CUDA driver: {context}{error}")]
    Driver {
        error: driver::DriverError,
        context: String,
    },
    #[error("{0}")]
    NvrtcMissing(String),
    /// A library found where NVRTC was looked for, which celer cannot use.
    #[error("{}: {reason}", path.display())]
    NvrtcUnusable {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("compiling {file} for {arch}: {log}")]
    Compile {
        arch: Arch,
        file: String,
        log: String,
    },
    #[error("kernel `{0}` is missing from the compiled module")]
    MissingKernel(&'static str),
    #[error("{what}: needs {needed} elements, the buffer holds {capacity}")]
    BufferTooSmall {
        what: &'static str,
        needed: usize,
        capacity: usize,
    },
    #[error("the image is {width}x{height}, over the GPU buffers' limit ({limit})")]
    ImageTooLarge {
        width: u32,
        height: u32,
        limit: String,
    },
    #[error("{stage}: {reason}")]
    Stage { stage: &'static str, reason: String },
}

impl From<driver::DriverError> for CudaError {
    fn from(error: driver::DriverError) -> Self {
        CudaError::Driver {
            error,
            context: String::new(),
        }
    }
}

impl CudaError {
    /// Whether the GPU's context is lost: after these errors ("sticky" in CUDA's words:
    /// an illegal address, a kernel fault, an uncorrectable ECC error, Hopper's error
    /// containment, or a code celer does not know: `driver::result::KNOWN`) every later
    /// call in the context fails, for every replica sharing it, until the context is
    /// destroyed and a new one created. The device must then be reopened, not retried.
    pub fn is_device_lost(&self) -> bool {
        match self {
            CudaError::Driver { error, .. } => error.is_device_lost(),
            _ => false,
        }
    }
}
