//! `OwnContext`: a context of celer's own on a GPU (`cuCtxCreate_v2`), beside the GPU's
//! primary context, for what must outlive a primary context's reset: the host pool's
//! page-locking. It runs no work, and is current on a thread only during its own calls.

use std::ffi::c_void;

use super::context::{init, register_in_current, unregister_in_current, Device};
use super::result::DriverError;
use super::sys::{self, CUcontext};

/// A context made with `cuCtxCreate_v2` on one GPU, destroyed on drop (`cuCtxDestroy_v2`).
/// No recovery resets it (a reset is of a primary context), so a registration made in it
/// lasts until it is unregistered or this is dropped. Each call pushes it on the calling
/// thread's context stack and pops it after, so the context current before (the GPU's
/// primary one, which TensorRT works in) stays current.
#[derive(Debug)]
pub struct OwnContext {
    device: Device,
    cu_ctx: CUcontext,
}

// SAFETY: a CUcontext is a handle any thread may use; each call here pushes it on the
// calling thread first and pops it after.
unsafe impl Send for OwnContext {}
// SAFETY: as above: `&self` methods only pass the handle to the driver.
unsafe impl Sync for OwnContext {}

impl OwnContext {
    /// Makes a context on `device`, leaving the calling thread's current context as it was.
    pub fn create(device: Device) -> Result<Self, DriverError> {
        init()?;
        let mut cu_ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: the pointer is valid for one write; flags 0 (CU_CTX_SCHED_AUTO: it never
        // waits for work); `device` is the driver's.
        unsafe { sys::cuCtxCreate_v2(&mut cu_ctx, 0, device.cu_device()) }.result()?;
        // Made from here: destroyed by Drop whatever happens next.
        let context = Self { device, cu_ctx };
        // cuCtxCreate pushed it on this thread's stack: pop it, the previous one current.
        context.pop()?;
        Ok(context)
    }

    pub fn ordinal(&self) -> usize {
        self.device.ordinal()
    }

    /// Pops the calling thread's current context, which the caller made this one.
    fn pop(&self) -> Result<(), DriverError> {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: the pointer is valid for one write.
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }.result()
    }

    /// Runs `call` with this context current on the calling thread, then makes the one
    /// current before current again.
    fn within(&self, call: impl FnOnce() -> Result<(), DriverError>) -> Result<(), DriverError> {
        // SAFETY: the handle is this context's, alive while `self` lives.
        unsafe { sys::cuCtxPushCurrent_v2(self.cu_ctx) }.result()?;
        let outcome = call();
        let popped = self.pop();
        outcome.and(popped)
    }

    /// Page-locks `[pointer, pointer + bytes)` in this context (`cuMemHostRegister_v2`,
    /// with `flags`: `CU_MEMHOSTREGISTER_*`; PORTABLE makes its copies DMA in every
    /// context).
    ///
    /// # Safety
    /// The range must be host memory of the caller's that stays allocated until it is
    /// unregistered ([`OwnContext::unregister_host`]) or this context is dropped.
    pub unsafe fn register_host(
        &self,
        pointer: *mut c_void,
        bytes: usize,
        flags: u32,
    ) -> Result<(), DriverError> {
        // SAFETY: forwarded to the caller; `within` makes this context current.
        self.within(|| unsafe { register_in_current(pointer, bytes, flags) })
    }

    /// Ends the registration that starts at `pointer` (`cuMemHostUnregister`).
    ///
    /// # Safety
    /// No copy from or to the range may still be queued, in any context.
    pub unsafe fn unregister_host(&self, pointer: *mut c_void) -> Result<(), DriverError> {
        // SAFETY: forwarded to the caller; `within` makes this context current.
        self.within(|| unsafe { unregister_in_current(pointer) })
    }
}

impl Drop for OwnContext {
    fn drop(&mut self) {
        // SAFETY: the handle is this context's, destroyed once, here; it is current on no
        // thread (each call popped it). Its registrations end with it.
        let destroyed = unsafe { sys::cuCtxDestroy_v2(self.cu_ctx) }.result();
        if let Err(error) = destroyed {
            tracing::warn!(gpu = self.device.ordinal(), %error, "destroying celer's own context failed");
        }
    }
}
