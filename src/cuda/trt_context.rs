//! What TensorRT needs of a GPU's CUDA context, in one place: the scope in which its
//! objects are made and destroyed with the context current (`TrtContext`), and whether a
//! failed enqueue lost the context (`sticky_error`). These are the TensorRT path's only
//! direct driver calls (cuCtxGetCurrent, cuCtxSetCurrent, cuStreamQuery).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use super::CudaError;
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
        let previous = result::ctx::get_current().map_err(|e| format!("cuCtxGetCurrent: {e:?}"))?;
        if previous == Some(ours) {
            f();
            return Ok(());
        }
        // SAFETY: `ours` is the primary context `self.context` holds retained, so it is
        // alive; making it current changes only this thread's binding.
        unsafe { result::ctx::set_current(ours) }.map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let _restore = Restore(previous);
        f();
        Ok(())
    }
}

/// Makes the thread's previous context (or none) current again, `f` unwinding or not.
struct Restore(Option<sys::CUcontext>);

impl Drop for Restore {
    fn drop(&mut self) {
        let previous = self.0.unwrap_or(std::ptr::null_mut());
        // SAFETY: `previous` was current on this thread just before (or is null, which
        // unbinds); what ran in between destroyed TensorRT objects, never a context. A
        // failure leaves the engine's context current, which is harmless: cudarc binds its
        // own before each use.
        let _ = unsafe { result::ctx::set_current(previous) };
    }
}

/// The sticky error of `stream`'s context, if it has one: asked when an enqueue failed, to
/// tell a refusal (that request's failure) from a lost context (the GPU's, for every
/// replica on it). cuStreamQuery, because it does not wait (the work queued before goes
/// on) and, as every call in a context whose error is sticky, returns that error; a
/// healthy stream answers done or not ready. Not cuCtxSynchronize: it would wait for every
/// replica's stream on the GPU.
pub fn sticky_error(stream: &CudaStream) -> Option<DriverError> {
    // SAFETY: `stream` owns a live stream handle; cuStreamQuery only reads its state.
    let status = unsafe { sys::cuStreamQuery(stream.cu_stream()) };
    match status {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => None,
        code => {
            let error = DriverError(code);
            CudaError::from(error).is_device_lost().then_some(error)
        }
    }
}
