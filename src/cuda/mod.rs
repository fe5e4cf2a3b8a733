//! The GPU as celer computes on it: the probe (which GPUs, what they are), one GPU's
//! context and kernels (`device`), NVRTC and the kernels (`kernels/*.cu`, compiled at
//! start-up for each GPU's architecture), their typed launchers (`launch`, `taps`), the
//! fast guided filter's buffers and steps (`guided`), model tensors on the device
//! (`tensor`), a TensorRT engine with its own buffers (`trt_model`) and what TensorRT needs
//! of the GPU's context (`trt_context`). How a replica
//! orders these for a request is `crate::replica::gpu`. The CPU stages in
//! `crate::stages` are the reference every kernel is tested against. Nothing here may
//! panic on a machine without a GPU: the probe comes first and says "no CUDA driver".
//! `unsafe` lives here (FFI, launches, the TensorRT model), each block with its reason.

pub mod arch;
pub mod device;
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
pub use device::{pinned, GpuDevice, PinnedBytes};
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
    #[error("CUDA driver: {context}{error:?}")]
    Driver {
        error: cudarc::driver::DriverError,
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

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(error: cudarc::driver::DriverError) -> Self {
        CudaError::Driver {
            error,
            context: String::new(),
        }
    }
}

impl CudaError {
    /// Whether the GPU's context is lost: after these errors ("sticky" in CUDA's words:
    /// an illegal address, a kernel fault, an uncorrectable ECC error) every later call in
    /// the context fails, for every replica sharing it, until the context is destroyed and
    /// a new one created. The device must then be reopened, not retried.
    pub fn is_device_lost(&self) -> bool {
        use cudarc::driver::sys::CUresult as R;
        match self {
            CudaError::Driver { error, .. } => matches!(
                error.0,
                R::CUDA_ERROR_ILLEGAL_ADDRESS
                    | R::CUDA_ERROR_HARDWARE_STACK_ERROR
                    | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
                    | R::CUDA_ERROR_MISALIGNED_ADDRESS
                    | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
                    | R::CUDA_ERROR_INVALID_PC
                    | R::CUDA_ERROR_LAUNCH_FAILED
                    | R::CUDA_ERROR_LAUNCH_TIMEOUT
                    | R::CUDA_ERROR_ECC_UNCORRECTABLE
                    | R::CUDA_ERROR_NVLINK_UNCORRECTABLE
                    | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
            ),
            _ => false,
        }
    }
}
