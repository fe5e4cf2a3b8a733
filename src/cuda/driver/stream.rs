//! `CudaStream`: one queue of work on the GPU (a non-blocking stream, so it never waits
//! for the legacy null stream), made, synchronised and destroyed. What is queued on it is
//! the other files': memory work (`queued`), events (`event`), launches (`launch`).

use std::sync::Arc;

use cudarc::driver::sys::CUstream_flags;

use super::context::CudaContext;
use super::counters::{count, LIVE};
use super::result::DriverError;
use super::sys::{self, CUstream, NOT_READY};

/// A stream of a context, destroyed on drop (work already queued still runs).
#[derive(Debug)]
pub struct CudaStream {
    cu_stream: CUstream,
    context: Arc<CudaContext>,
}

// SAFETY: a CUstream is a handle any thread may use once its context is current (each
// call here binds it first); the driver serialises what is queued on it.
unsafe impl Send for CudaStream {}
// SAFETY: as above: `&self` methods only pass the handle to the driver.
unsafe impl Sync for CudaStream {}

impl PartialEq for CudaStream {
    fn eq(&self, other: &Self) -> bool {
        self.cu_stream == other.cu_stream
    }
}

impl Eq for CudaStream {}

impl CudaContext {
    /// A new non-blocking stream (`CU_STREAM_NON_BLOCKING`).
    pub fn new_stream(self: &Arc<Self>) -> Result<Arc<CudaStream>, DriverError> {
        self.bind_to_thread()?;
        let mut cu_stream: CUstream = std::ptr::null_mut();
        let flags = CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the out-pointer is valid for one write.
        unsafe { sys::cuStreamCreate(&mut cu_stream, flags) }.result()?;
        Ok(Arc::new(CudaStream {
            cu_stream,
            context: self.clone(),
        }))
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        let destroyed = self.context.bind_to_thread().and_then(|()| {
            // SAFETY: the stream is this value's own, destroyed once; every buffer
            // allocated on it holds an Arc of it, so none outlives it.
            unsafe { sys::cuStreamDestroy_v2(self.cu_stream) }.result()
        });
        self.context.record_release("a stream", destroyed);
    }
}

impl CudaStream {
    /// The raw handle, for libraries that enqueue on it (TensorRT). Never destroy it.
    pub fn cu_stream(&self) -> CUstream {
        self.cu_stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// Waits until everything queued so far has run (`cuStreamSynchronize`).
    pub fn synchronize(&self) -> Result<(), DriverError> {
        self.context.bind_to_thread()?;
        count(&LIVE.stream_syncs);
        // SAFETY: the stream is live while `self` is.
        unsafe { sys::cuStreamSynchronize(self.cu_stream) }.result()
    }

    /// Whether everything queued so far has run, without waiting (`cuStreamQuery`): the
    /// context's sticky error, when it has one, comes back as the error.
    pub fn query(&self) -> Result<bool, DriverError> {
        self.context.bind_to_thread()?;
        // SAFETY: the stream is live while `self` is; the call only reads its state.
        let answer = unsafe { sys::cuStreamQuery(self.cu_stream) };
        if answer.code == Ok(NOT_READY) {
            return Ok(false);
        }
        answer.result().map(|()| true)
    }
}
