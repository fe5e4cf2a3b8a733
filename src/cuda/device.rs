//! One GPU: its context (the primary context, one per GPU per process), what the probe
//! says about it, and the kernels loaded into it. Shared by the replicas on that GPU
//! (each makes its own stream); the kernels are compiled once per architecture.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaStream, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

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
        // SAFETY: every device buffer of celer belongs to one replica and is used only on
        // that replica's stream, so the cross-stream event tracking that cudarc would
        // record on each use is never needed. Set before any allocation in the context.
        unsafe { context.disable_event_tracking() };
        let driver = driver_version()?;
        let cubins = cubins_for(info.arch(), driver)?;
        let mut functions = HashMap::new();
        for (file, (name, cubin)) in FILES.iter().zip(&cubins.files) {
            let module = context
                .load_module(Ptx::from_binary(cubin.clone()))
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

    /// An event that records time. cudarc's default event has timing disabled, and
    /// `elapsed_ms` between two of those fails.
    pub fn timing_event(&self) -> Result<CudaEvent, CudaError> {
        Ok(self
            .context
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
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
    let device = cudarc::driver::result::device::get(ordinal as i32)?;
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: `device` is a device of the initialised driver; both out pointers are valid.
    unsafe { sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) }.result()?;
    if active == 0 {
        return Ok(false);
    }
    // SAFETY: the caller guarantees nothing of the old context is in use (see above); the
    // references others hold stay valid handles to a fresh context, as CUDA documents.
    unsafe { sys::cuDevicePrimaryCtxReset_v2(device) }.result()?;
    Ok(true)
}

/// `len` zeroed elements of page-locked host memory in `context` (at least one), for a
/// stream's copies to and from the host to run as DMA. Write-combined memory is fast for
/// the host to write and the GPU to read, and very slow for the host to read: only for
/// uploads.
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
    let len = len.max(1);
    // SAFETY: cuMemHostAlloc returns uninitialised memory; it is zeroed through the raw
    // pointer below before any reference to its contents exists.
    let mut buf = unsafe { context.alloc_pinned_with_flags::<T>(len, flags) }?;
    let ptr = buf.as_mut_ptr()?;
    // SAFETY: `ptr` points to `len` elements of T, valid for writes; all-zero bits are a
    // valid T (`ValidAsZeroBits`).
    unsafe { std::ptr::write_bytes(ptr, 0, len) };
    Ok(buf)
}

/// Page-locked bytes for a stream's staging, read and written as plain slices without a
/// host synchronisation: cudarc's `PinnedHostSlice::as_slice` waits on an event of its
/// own each time (a host synchronisation per call, though the event is never recorded
/// when copies are given plain slices, as here). The owner orders host and device access
/// itself: it synchronises the stream before reading what a copy wrote, or writing what
/// a queued copy reads.
pub struct PinnedBytes {
    /// Owns the allocation (unpinned on drop, after its event).
    _slice: PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is to page-locked host memory owned by `_slice` (itself Send and
// Sync); access goes through `&self`/`&mut self`, so Rust's borrow rules hold.
unsafe impl Send for PinnedBytes {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for PinnedBytes {}

impl PinnedBytes {
    /// `len` zeroed bytes (at least one) in `context`; write-combined for uploads only.
    pub fn new(
        context: &Arc<CudaContext>,
        len: usize,
        write_combined: bool,
    ) -> Result<Self, CudaError> {
        let mut slice = pinned::<u8>(context, len, write_combined)?;
        let len = slice.len();
        // The one event wait, at allocation (nothing is queued on it).
        let ptr = slice.as_mut_ptr()?;
        Ok(Self {
            _slice: slice,
            ptr,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes, initialised (zeroed at allocation), for
        // as long as `self` holds the allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Milliseconds between two events that have completed (their stream was synchronised
/// after both were recorded). cudarc's `CudaEvent::elapsed_ms` synchronises each event
/// first: two more host waits per reading, on events already complete.
pub fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32, CudaError> {
    start.context().bind_to_thread()?;
    // SAFETY: both handles are live events of the bound context (each `CudaEvent` owns its
    // handle); cuEventElapsedTime only reads their recorded times, and answers
    // CUDA_ERROR_NOT_READY (an error, not undefined behaviour) if one is not complete.
    Ok(unsafe { cudarc::driver::result::event::elapsed(start.cu_event(), end.cu_event()) }?)
}
