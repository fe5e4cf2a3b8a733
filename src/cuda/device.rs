//! One GPU: its context (the primary context, one per GPU per process), what the probe
//! says about it, and the kernels loaded into it. Shared by the replicas on that GPU
//! (each makes its own stream); the kernels are compiled once per architecture.

use std::collections::HashMap;
use std::sync::Arc;

use super::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaStream, Device, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};

use super::kernels::{cubins_for, FILES};
use super::probe::{driver_present, driver_version, GpuInfo};
use super::CudaError;

/// The kernels of every `.cu` file, by name, loaded in one context.
pub struct KernelSet {
    functions: HashMap<&'static str, CudaFunction>,
}

impl KernelSet {
    pub fn get(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        self.functions
            .get(name)
            .ok_or(CudaError::MissingKernel(name))
    }
}

/// A GPU ready to run celer's kernels.
pub struct GpuDevice {
    pub info: GpuInfo,
    context: Arc<CudaContext>,
    kernels: KernelSet,
}

impl GpuDevice {
    /// Opens GPU `info.ordinal`: retains its primary context, compiles (or takes from
    /// the cache) the kernels for its architecture and loads them.
    pub fn open(info: GpuInfo) -> Result<Arc<Self>, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let context = CudaContext::new(info.ordinal)?;
        // A replica thread that waits for its stream sleeps until the GPU is done instead of
        // spinning a core (the primary context's default, CU_CTX_SCHED_AUTO, spins when the
        // GPUs do not outnumber the cores): the cores stay free for decode, encode and
        // ONNX Runtime. One wait costs a few microseconds more, a request's one sync at the
        // end of its stages (two more with ONNX Runtime models).
        context.set_blocking_synchronize()?;
        let driver = driver_version()?;
        let cubins = cubins_for(info.arch(), driver)?;
        let mut functions = HashMap::new();
        for (file, (name, cubin)) in FILES.iter().zip(&cubins.files) {
            let module = context
                .load_module(cubin)
                .map_err(|error| CudaError::Driver {
                    error,
                    context: format!(
                        "loading {name} for {} (NVRTC {}) into GPU {} ({}, CUDA {driver} driver): ",
                        info.arch(),
                        cubins.nvrtc,
                        info.ordinal,
                        info.name
                    ),
                })?;
            for &kernel in file.kernels {
                functions.insert(kernel, module.load_function(kernel)?);
            }
        }
        Ok(Arc::new(Self {
            info,
            context,
            kernels: KernelSet { functions },
        }))
    }

    /// A new stream for one replica.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        Ok(self.context.new_stream()?)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// An event that records time (events made without it are cheaper, and
    /// `elapsed_ms` between two of those fails).
    pub fn timing_event(&self) -> Result<CudaEvent, CudaError> {
        Ok(self.context.timing_event()?)
    }

    pub fn kernels(&self) -> &KernelSet {
        &self.kernels
    }
}

/// Makes GPU `ordinal`'s primary context current on this thread, for TensorRT (which
/// works in the context current on the calling thread) outside a `GpuDevice`: `celer
/// build` and `celer inspect`. The context stays retained while the result lives.
pub fn bind(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let context = CudaContext::new(ordinal)?;
    context.bind_to_thread()?;
    Ok(context)
}

/// Destroys GPU `ordinal`'s primary context when it outlived celer's last reference to it,
/// and says whether it did. Recovering a lost context (a sticky error) means destroying
/// it: celer drops every reference of its own first, and the driver destroys a primary
/// context at its last release. But a library that retains the context for itself keeps
/// it alive, sticky error and all: the CUDA runtime inside TensorRT does, for the life of
/// the process. `cuDevicePrimaryCtxReset` destroys it regardless of those references (they
/// stay counted, and a fresh context serves them), so it is only safe once nothing of the
/// old context is in use: celer's engines and buffers are gone, and TensorRT holds no
/// object in it.
pub fn reset_if_held(ordinal: usize) -> Result<bool, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let device = Device::get(ordinal)?;
    if !device.primary_context_state()?.active {
        return Ok(false);
    }
    // SAFETY: the caller guarantees nothing of the old context is in use (see above); the
    // references others hold stay valid handles to a fresh context, as CUDA documents.
    unsafe { device.reset_primary_context() }?;
    Ok(true)
}

/// `len` zeroed elements of page-locked host memory in `context` (at least one), for a
/// stream's copies to and from the host to run as DMA. Write-combined memory is fast for
/// the host to write and the GPU to read, and very slow for the host to read: only for
/// uploads. Read and written as plain slices, without a host synchronisation: the owner
/// synchronises the stream before reading what a copy wrote, or writing what a queued copy
/// reads.
pub fn pinned<T: DeviceRepr + ValidAsZeroBits>(
    context: &Arc<CudaContext>,
    len: usize,
    write_combined: bool,
) -> Result<PinnedHostSlice<T>, CudaError> {
    let flags = if write_combined {
        sys::CU_MEMHOSTALLOC_WRITECOMBINED
    } else {
        0
    };
    Ok(context.alloc_pinned::<T>(len, flags)?)
}
