//! What TensorRT needs of a GPU's CUDA context, in one place: the scope in which its
//! objects are made and destroyed with the context current (`TrtContext`), and whether a
//! failed enqueue lost the context (`sticky_error`). These are the TensorRT path's only
//! direct driver calls (cuCtxGetCurrent, cuCtxSetCurrent, cuStreamQuery).

use std::sync::Arc;

use super::driver::{self, sys::CUcontext, CudaContext, CudaStream, DriverError};
use crate::tensorrt::CudaContextScope;

/// A GPU's context as the TensorRT objects made in it need it: retained while they live
/// (they hold this), and current on the calling thread while one is made or destroyed, on
/// whichever thread that happens (a replica's, a recovery's, the one that shuts down).
pub struct TrtContext {
    context: Arc<CudaContext>,
}

impl TrtContext {
    /// The scope of `context` for `crate::tensorrt`'s runtime, engines and execution
    /// contexts.
    pub fn scope(context: &Arc<CudaContext>) -> Arc<dyn CudaContextScope> {
        Arc::new(Self {
            context: context.clone(),
        })
    }
}

impl CudaContextScope for TrtContext {
    fn with_current(&self, f: &mut dyn FnMut()) -> Result<(), String> {
        let ours = self.context.cu_ctx();
        let previous = driver::current().map_err(|e| e.to_string())?;
        if previous == ours {
            f();
            return Ok(());
        }
        // SAFETY: `ours` is the primary context `self.context` holds retained, so it is
        // alive; making it current changes only this thread's binding.
        unsafe { driver::set_current(ours) }.map_err(|e| e.to_string())?;
        let _restore = Restore(previous);
        f();
        Ok(())
    }
}

/// Makes the thread's previous context (or none) current again, `f` unwinding or not.
struct Restore(CUcontext);

impl Drop for Restore {
    fn drop(&mut self) {
        // SAFETY: `self.0` was current on this thread just before (or is null, which
        // unbinds); what ran in between destroyed TensorRT objects, never a context. A
        // failure leaves the engine's context current, which is harmless: celer's driver
        // layer binds its own before each use.
        let _ = unsafe { driver::set_current(self.0) };
    }
}

/// The sticky error of `stream`'s context, if it has one: asked when an enqueue failed, to
/// tell a refusal (that request's failure) from a lost context (the GPU's, for every
/// replica on it). cuStreamQuery, because it does not wait (the work queued before goes
/// on) and, as every call in a context whose error is sticky, returns that error; a
/// healthy stream answers done or not ready. Not cuCtxSynchronize: it would wait for every
/// replica's stream on the GPU.
pub fn sticky_error(stream: &CudaStream) -> Option<DriverError> {
    match stream.query() {
        Ok(_) => None,
        Err(error) => error.is_device_lost().then_some(error),
    }
}
