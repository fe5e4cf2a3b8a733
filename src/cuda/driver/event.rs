//! `CudaEvent`: a point in a stream, recorded there (`record`, `CudaStream::record_event`)
//! and waited for by the host (`synchronize`) or another stream (`CudaStream::wait`); made with timing, two recorded
//! ones give the GPU time between them (`elapsed_ms`).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;

use super::context::CudaContext;
use super::counters::{count, LIVE};
use super::result::DriverError;
use super::stream::CudaStream;
use super::sys::{self, CUevent};

/// An event of a context, destroyed on drop.
#[derive(Debug)]
pub struct CudaEvent {
    cu_event: CUevent,
    context: Arc<CudaContext>,
}

// SAFETY: a CUevent is a handle any thread may use once its context is current (each call
// here binds it first).
unsafe impl Send for CudaEvent {}
// SAFETY: as above: `&self` methods only pass the handle to the driver.
unsafe impl Sync for CudaEvent {}

impl CudaContext {
    /// A new event; `None` makes it without timing (`CU_EVENT_DISABLE_TIMING`: cheaper,
    /// and `elapsed_ms` refuses it), `Some(CU_EVENT_DEFAULT)` with.
    pub fn new_event(
        self: &Arc<Self>,
        flags: Option<CUevent_flags>,
    ) -> Result<CudaEvent, DriverError> {
        let flags = flags.unwrap_or(CUevent_flags::CU_EVENT_DISABLE_TIMING);
        self.bind_to_thread()?;
        let mut cu_event: CUevent = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid for one write; the flags are CUDA's.
        unsafe { sys::cuEventCreate(&mut cu_event, flags as u32) }.result()?;
        Ok(CudaEvent {
            cu_event,
            context: self.clone(),
        })
    }

    /// An event that records time (`CU_EVENT_DEFAULT`).
    pub fn timing_event(self: &Arc<Self>) -> Result<CudaEvent, DriverError> {
        self.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
    }
}

impl CudaEvent {
    /// The raw handle. Never destroy it.
    pub fn cu_event(&self) -> CUevent {
        self.cu_event
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// Records where `stream` is now (`cuEventRecord`); the stream must be of the
    /// event's context.
    pub fn record(&self, stream: &CudaStream) -> Result<(), DriverError> {
        if **stream.context() != *self.context {
            return Err(DriverError::refused(
                "cuEventRecord",
                "the stream is of another context than the event",
            ));
        }
        self.context.bind_to_thread()?;
        // SAFETY: both handles are live while `self` and `stream` are.
        unsafe { sys::cuEventRecord(self.cu_event, stream.cu_stream()) }.result()
    }

    /// Waits until the stream has run the last record (`cuEventSynchronize`).
    pub fn synchronize(&self) -> Result<(), DriverError> {
        self.context.bind_to_thread()?;
        count(&LIVE.event_syncs);
        // SAFETY: the handle is live while `self` is.
        unsafe { sys::cuEventSynchronize(self.cu_event) }.result()
    }

    /// Milliseconds of GPU time from this event to `end`, both made with timing and both
    /// complete (their stream ran past them: synchronise first). Only reads their times:
    /// `cuEventElapsedTime`, not CUDA 12.8's `_v2`, which celer's floor lacks.
    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f32, DriverError> {
        self.context.bind_to_thread()?;
        let mut ms = 0f32;
        // SAFETY: the out-pointer is valid for one write; both handles are live. An
        // incomplete or untimed event is an error the driver answers.
        unsafe { sys::cuEventElapsedTime(&mut ms, self.cu_event, end.cu_event) }.result()?;
        Ok(ms)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let destroyed = self.context.bind_to_thread().and_then(|()| {
            // SAFETY: the event is this value's own, destroyed once.
            unsafe { sys::cuEventDestroy_v2(self.cu_event) }.result()
        });
        self.context.record_release("an event", destroyed);
    }
}

impl CudaStream {
    /// A new event recording where this stream is now (`None`: without timing).
    pub fn record_event(
        self: &Arc<Self>,
        flags: Option<CUevent_flags>,
    ) -> Result<CudaEvent, DriverError> {
        let event = self.context().new_event(flags)?;
        event.record(self)?;
        Ok(event)
    }

    /// Makes everything queued on this stream from now on wait until `event`'s record has
    /// run (`cuStreamWaitEvent`).
    pub fn wait(&self, event: &CudaEvent) -> Result<(), DriverError> {
        self.context().bind_to_thread()?;
        // SAFETY: both handles are live while `self` and `event` are; flags 0 (default).
        unsafe { sys::cuStreamWaitEvent(self.cu_stream(), event.cu_event(), 0) }.result()
    }
}
