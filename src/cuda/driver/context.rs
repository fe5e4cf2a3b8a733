//! The driver, its devices and a device's primary context: `init` and the probe's
//! queries (`driver_version`, `device_count`, `Device`), and `CudaContext`, the primary
//! context retained for as long as celer holds it (released on drop), with what every
//! other handle of this layer needs from it: binding to the calling thread, whether the
//! device has memory pools, the blocking-sync flag, page-locking host memory.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{CUctx_flags, CUdevice_attribute};

use super::counters::{count_bytes, LIVE};
use super::result::DriverError;
use super::sys::{self, CUcontext, CUdevice};

/// `cuInit(0)`: before any call but `cuDriverGetVersion`. Repeated calls are cheap.
pub fn init() -> Result<(), DriverError> {
    // SAFETY: no pointers; flags must be 0.
    unsafe { sys::cuInit(0) }.result()
}

/// `cuDriverGetVersion`: e.g. 12020 for CUDA 12.2. Every driver has it, and it needs no
/// `cuInit`.
pub fn driver_version() -> Result<i32, DriverError> {
    let mut version = 0;
    // SAFETY: the pointer is valid for one write.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

/// The number of GPUs the driver sees (after [`init`]).
pub fn device_count() -> Result<usize, DriverError> {
    let mut count: c_int = 0;
    // SAFETY: the pointer is valid for one write.
    unsafe { sys::cuDeviceGetCount(&mut count) }.result()?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// One GPU as the driver numbers it (after [`init`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    ordinal: usize,
    cu_device: CUdevice,
}

impl Device {
    /// GPU `ordinal`.
    pub fn get(ordinal: usize) -> Result<Self, DriverError> {
        let index = c_int::try_from(ordinal)
            .map_err(|_| DriverError::refused("cuDeviceGet", format!("ordinal {ordinal}")))?;
        let mut cu_device: CUdevice = 0;
        // SAFETY: the pointer is valid for one write; the driver checks the ordinal.
        unsafe { sys::cuDeviceGet(&mut cu_device, index) }.result()?;
        Ok(Self { ordinal, cu_device })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn cu_device(&self) -> CUdevice {
        self.cu_device
    }

    /// An attribute's value (an integer, whatever the attribute).
    pub fn attribute(&self, attribute: CUdevice_attribute) -> Result<i32, DriverError> {
        let mut value: c_int = 0;
        // SAFETY: the pointer is valid for one write; the attribute goes to the driver as
        // the integer CUDA defines for it.
        unsafe { sys::cuDeviceGetAttribute(&mut value, attribute as c_int, self.cu_device) }
            .result()?;
        Ok(value)
    }

    /// The GPU's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> Result<String, DriverError> {
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds `len` bytes; the driver writes a NUL-terminated name
        // that fits (truncating it if need be).
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, self.cu_device) }
            .result()?;
        let bytes: Vec<u8> = name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The GPU's UUID bytes.
    pub fn uuid(&self) -> Result<[u8; 16], DriverError> {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: the pointer is valid for one CUuuid (16 bytes, plain data).
        unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, self.cu_device) }.result()?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// The GPU's memory in bytes.
    pub fn total_memory(&self) -> Result<usize, DriverError> {
        let mut bytes = 0usize;
        // SAFETY: the pointer is valid for one write.
        unsafe { sys::cuDeviceTotalMem_v2(&mut bytes, self.cu_device) }.result()?;
        Ok(bytes)
    }

    /// Whether GPU `ordinal`'s primary context exists and is retained, and its flags
    /// (`cuDevicePrimaryCtxGetState`).
    pub fn primary_context_state(&self) -> Result<PrimaryContextState, DriverError> {
        let (mut flags, mut active) = (0u32, 0 as c_int);
        // SAFETY: both pointers are valid for one write.
        unsafe { sys::cuDevicePrimaryCtxGetState(self.cu_device, &mut flags, &mut active) }
            .result()?;
        Ok(PrimaryContextState {
            flags,
            active: active != 0,
        })
    }

    /// Destroys the GPU's primary context, whoever holds it (`cuDevicePrimaryCtxReset_v2`):
    /// its memory, streams, events, modules and sticky error go; the references to it stay
    /// counted, and the next use through them gets a fresh context.
    ///
    /// # Safety
    /// Nothing of the old context may be in use: every handle made in it is dead after
    /// this (dropping one only fails, which is logged).
    pub unsafe fn reset_primary_context(&self) -> Result<(), DriverError> {
        // SAFETY: forwarded to the caller.
        unsafe { sys::cuDevicePrimaryCtxReset_v2(self.cu_device) }.result()
    }
}

/// What `cuDevicePrimaryCtxGetState` says of a primary context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrimaryContextState {
    pub flags: u32,
    /// It exists and someone retains it.
    pub active: bool,
}

/// The context current on the calling thread (null when none is).
pub fn current() -> Result<CUcontext, DriverError> {
    let mut current: CUcontext = std::ptr::null_mut();
    // SAFETY: the pointer is valid for one write.
    unsafe { sys::cuCtxGetCurrent(&mut current) }.result()?;
    Ok(current)
}

/// Makes `context` current on the calling thread (null: none).
///
/// # Safety
/// `context` is null, or a context that is alive (retained by someone) while it is current.
pub unsafe fn set_current(context: CUcontext) -> Result<(), DriverError> {
    // SAFETY: forwarded to the caller.
    unsafe { sys::cuCtxSetCurrent(context) }.result()
}

/// A GPU's primary context, retained while this lives (one per GPU per process, shared
/// with anyone else who retains it, TensorRT's runtime included). Every handle of this
/// layer holds an `Arc` of its context, and binds it to the calling thread before each
/// call, so any thread may use them.
#[derive(Debug)]
pub struct CudaContext {
    device: Device,
    cu_ctx: CUcontext,
    /// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`: device memory is then allocated and
    /// freed in stream order (`cuMemAllocAsync`/`cuMemFreeAsync`), else with
    /// `cuMemAlloc_v2`/`cuMemFree_v2`.
    memory_pools: bool,
    /// Failures of the releases made on drop (frees, destroys) of this context's handles.
    release_failures: AtomicU64,
}

// SAFETY: a CUcontext is a handle that the driver lets any thread use (each call here
// makes it current on the calling thread first); the other fields are plain or atomic.
unsafe impl Send for CudaContext {}
// SAFETY: as above: `&self` methods only pass the handle to the driver.
unsafe impl Sync for CudaContext {}

impl CudaContext {
    /// Retains GPU `ordinal`'s primary context and makes it current on this thread.
    pub fn new(ordinal: usize) -> Result<Arc<Self>, DriverError> {
        init()?;
        let device = Device::get(ordinal)?;
        let mut cu_ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: the pointer is valid for one write; `device` is the driver's.
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut cu_ctx, device.cu_device) }.result()?;
        // Retained from here: released by Drop whatever happens next.
        let mut context = Self {
            device,
            cu_ctx,
            memory_pools: false,
            release_failures: AtomicU64::new(0),
        };
        context.memory_pools =
            device.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? > 0;
        context.bind_to_thread()?;
        Ok(Arc::new(context))
    }

    pub fn ordinal(&self) -> usize {
        self.device.ordinal
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw handle, for libraries that take one. Never release it.
    pub fn cu_ctx(&self) -> CUcontext {
        self.cu_ctx
    }

    /// Whether device memory is allocated in stream order (the device has memory pools).
    pub fn has_memory_pools(&self) -> bool {
        self.memory_pools
    }

    /// Makes this context current on the calling thread (unless it is already).
    pub fn bind_to_thread(&self) -> Result<(), DriverError> {
        let mut current: CUcontext = std::ptr::null_mut();
        // SAFETY: the pointer is valid for one write.
        unsafe { sys::cuCtxGetCurrent(&mut current) }.result()?;
        if current != self.cu_ctx {
            // SAFETY: the handle is this context's, retained while `self` lives; the
            // driver refuses it (an error, not undefined behaviour) once reset.
            unsafe { sys::cuCtxSetCurrent(self.cu_ctx) }.result()?;
        }
        Ok(())
    }

    /// A thread waiting for this context's work sleeps until the GPU is done, instead of
    /// spinning (`CU_CTX_SCHED_BLOCKING_SYNC`; `cuCtxSetFlags`, CUDA 12.1).
    pub fn set_blocking_synchronize(&self) -> Result<(), DriverError> {
        self.bind_to_thread()?;
        // SAFETY: no pointers; the flag is one CUDA defines.
        unsafe { sys::cuCtxSetFlags(CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC as u32) }.result()
    }

    /// The context's flags (`cuCtxGetFlags`), e.g. its scheduling policy in bits 0-2.
    pub fn flags(&self) -> Result<u32, DriverError> {
        self.bind_to_thread()?;
        let mut flags = 0u32;
        // SAFETY: the pointer is valid for one write.
        unsafe { sys::cuCtxGetFlags(&mut flags) }.result()?;
        Ok(flags)
    }

    /// Waits for every stream of the context (`cuCtxSynchronize`).
    pub fn synchronize(&self) -> Result<(), DriverError> {
        self.bind_to_thread()?;
        super::counters::count(&LIVE.context_syncs);
        // SAFETY: no arguments; works in the context just made current.
        unsafe { sys::cuCtxSynchronize() }.result()
    }

    /// An attribute of the context's GPU.
    pub fn attribute(&self, attribute: CUdevice_attribute) -> Result<i32, DriverError> {
        self.device.attribute(attribute)
    }

    /// The name of the context's GPU.
    pub fn name(&self) -> Result<String, DriverError> {
        self.device.name()
    }

    /// Page-locks `[pointer, pointer + bytes)` (`cuMemHostRegister_v2`, with `flags`:
    /// `CU_MEMHOSTREGISTER_*`), so that copies from and to it run as DMA.
    ///
    /// # Safety
    /// The range must be host memory of the caller's that stays allocated until it is
    /// unregistered ([`CudaContext::unregister_host`]) or this context is destroyed.
    pub unsafe fn register_host(
        &self,
        pointer: *mut c_void,
        bytes: usize,
        flags: u32,
    ) -> Result<(), DriverError> {
        self.bind_to_thread()?;
        // SAFETY: forwarded to the caller; this context is current.
        unsafe { register_in_current(pointer, bytes, flags) }
    }

    /// Ends the registration that starts at `pointer` (`cuMemHostUnregister`).
    ///
    /// # Safety
    /// No copy from or to the range may still be queued.
    pub unsafe fn unregister_host(&self, pointer: *mut c_void) -> Result<(), DriverError> {
        self.bind_to_thread()?;
        // SAFETY: forwarded to the caller; this context is current.
        unsafe { unregister_in_current(pointer) }
    }

    /// How many releases of this context's handles (frees, destroys) failed on drop.
    pub fn release_failures(&self) -> u64 {
        self.release_failures.load(Ordering::Relaxed)
    }

    /// Records the outcome of a release made on drop, where nothing can be returned: the
    /// first failure in this context is a warning, later ones (a lost context fails every
    /// release of its buffers) only debug lines. Never panics.
    pub(crate) fn record_release(&self, what: &str, outcome: Result<(), DriverError>) {
        if let Err(error) = outcome {
            let earlier = self.release_failures.fetch_add(1, Ordering::Relaxed);
            if earlier == 0 {
                tracing::warn!(gpu = self.device.ordinal, %error, "releasing {what} failed");
            } else {
                tracing::debug!(gpu = self.device.ordinal, %error, "releasing {what} failed");
            }
        }
    }
}

impl Drop for CudaContext {
    fn drop(&mut self) {
        // SAFETY: this retain's release; the driver destroys the context at the last one.
        let released = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device.cu_device) };
        self.record_release("the primary context", released.result());
    }
}

impl PartialEq for CudaContext {
    fn eq(&self, other: &Self) -> bool {
        self.cu_ctx == other.cu_ctx && self.device == other.device
    }
}

impl Eq for CudaContext {}

/// Page-locks `[pointer, pointer + bytes)` in the calling thread's current context
/// (`cuMemHostRegister_v2`), counted: what `CudaContext::register_host` and
/// `OwnContext::register_host` do once each has made its context current.
///
/// # Safety
/// As `CudaContext::register_host`, for the current context.
pub(super) unsafe fn register_in_current(
    pointer: *mut c_void,
    bytes: usize,
    flags: u32,
) -> Result<(), DriverError> {
    count_bytes(
        &LIVE.host_registrations,
        &LIVE.host_registration_bytes,
        bytes,
    );
    // SAFETY: forwarded to the caller; the driver records the range, writing nothing.
    unsafe { sys::cuMemHostRegister_v2(pointer, bytes, flags) }.result()
}

/// Ends the registration that starts at `pointer` in the calling thread's current context
/// (`cuMemHostUnregister`).
///
/// # Safety
/// No copy from or to the range may still be queued.
pub(super) unsafe fn unregister_in_current(pointer: *mut c_void) -> Result<(), DriverError> {
    // SAFETY: forwarded to the caller; the driver looks the pointer up, touching no memory.
    unsafe { sys::cuMemHostUnregister(pointer) }.result()
}
