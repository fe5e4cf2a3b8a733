//! Kernels: a compiled module loaded into a context (`CudaModule`, unloaded on drop) and
//! its functions (`CudaFunction`, which keep their module loaded).

use std::ffi::{c_void, CString};
use std::sync::Arc;

use super::context::CudaContext;
use super::result::DriverError;
use super::sys::{self, CUfunction, CUmodule};

/// A module loaded into a context.
#[derive(Debug)]
pub struct CudaModule {
    cu_module: CUmodule,
    context: Arc<CudaContext>,
}

// SAFETY: a CUmodule is a handle any thread may use once its context is current.
unsafe impl Send for CudaModule {}
// SAFETY: as above: `&self` methods only pass the handle to the driver.
unsafe impl Sync for CudaModule {}

/// The ELF magic a CUBIN starts with.
const ELF_MAGIC: &[u8] = b"\x7fELF";

impl CudaContext {
    /// Loads a CUBIN (NVRTC's output for this GPU's architecture) into this context
    /// (`cuModuleLoadData`). Anything but an ELF image is refused before the driver, which
    /// reads the image by its own headers, sees it.
    pub fn load_module(self: &Arc<Self>, cubin: &[u8]) -> Result<Arc<CudaModule>, DriverError> {
        if !cubin.starts_with(ELF_MAGIC) || cubin.len() < 64 {
            return Err(DriverError::refused(
                "cuModuleLoadData",
                "the image is not a CUBIN (an ELF file)",
            ));
        }
        self.bind_to_thread()?;
        let mut cu_module: CUmodule = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid for one write; the image is a whole ELF file
        // that outlives the call (the driver copies what it keeps).
        unsafe { sys::cuModuleLoadData(&mut cu_module, cubin.as_ptr().cast::<c_void>()) }
            .result()?;
        Ok(Arc::new(CudaModule {
            cu_module,
            context: self.clone(),
        }))
    }
}

impl CudaModule {
    /// Kernel `name` of the module.
    pub fn load_function(self: &Arc<Self>, name: &str) -> Result<CudaFunction, DriverError> {
        let c_name = CString::new(name)
            .map_err(|_| DriverError::refused("cuModuleGetFunction", "a name with a NUL"))?;
        self.context.bind_to_thread()?;
        let mut cu_function: CUfunction = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid for one write; the module is live while `self`
        // is; the name is NUL-terminated and outlives the call.
        unsafe { sys::cuModuleGetFunction(&mut cu_function, self.cu_module, c_name.as_ptr()) }
            .result()?;
        Ok(CudaFunction {
            cu_function,
            _module: self.clone(),
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }
}

impl Drop for CudaModule {
    fn drop(&mut self) {
        let unloaded = self.context.bind_to_thread().and_then(|()| {
            // SAFETY: the module is this value's own, unloaded once; every function of it
            // holds an Arc of it, so none outlives it.
            unsafe { sys::cuModuleUnload(self.cu_module) }.result()
        });
        self.context.record_release("a module", unloaded);
    }
}

/// A kernel of a loaded module; keeps the module loaded.
#[derive(Debug, Clone)]
pub struct CudaFunction {
    cu_function: CUfunction,
    _module: Arc<CudaModule>,
}

// SAFETY: a CUfunction is a handle any thread may use once its context is current.
unsafe impl Send for CudaFunction {}
// SAFETY: as above.
unsafe impl Sync for CudaFunction {}

impl CudaFunction {
    /// The raw handle, valid while `self` lives.
    pub fn cu_function(&self) -> CUfunction {
        self.cu_function
    }
}
