//! The driver's entry points as celer declares them: every one celer calls, each resolved
//! by name on its first call (once: a `OnceLock` per entry point) from the library
//! cudarc's loader opened, with a signature whose return type is the raw `CUresult`
//! integer. A driver newer than any bindings returns codes no Rust enum lists; read as an
//! integer, such a code is a value like any other, never undefined behaviour. Out-
//! parameters are integers and plain structs too: nothing the driver writes is read as an
//! enum. Types passed *to* the driver (handles, `CUdeviceptr`, `CUuuid`) are cudarc's.
//!
//! A missing entry point (a driver older than it) or a missing library is an error naming
//! it (`Answer::code`), never a panic. `ENTRY_POINTS` lists every name this file can
//! resolve; tests/driver_floor.rs checks that a CUDA 12.2 driver (celer's floor) exports
//! each of them.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

pub use cudarc::driver::sys::{
    CUcontext, CUctx_flags, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUevent_flags,
    CUfunction, CUmodule, CUstream, CUuuid, CU_MEMHOSTALLOC_WRITECOMBINED,
    CU_MEMHOSTREGISTER_PORTABLE,
};

/// A `CUresult` as the driver returns it: an integer.
pub type RawResult = c_uint;

/// `CUDA_SUCCESS`.
pub const SUCCESS: RawResult = 0;

/// `CUDA_ERROR_NOT_READY`: queued work has not all run yet (`cuStreamQuery`); not a failure.
pub const NOT_READY: RawResult = 600;

/// What one call of an entry point came to: the driver's raw answer, or why the entry
/// point could not be called. `result::Answer::result` turns it into a `Result`.
#[must_use = "a driver call's answer says whether it worked"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The entry point, by the name it was resolved by (e.g. `cuMemcpyHtoDAsync_v2`).
    pub call: &'static str,
    /// The driver's `CUresult`, or why the entry point was not resolved.
    pub code: Result<RawResult, String>,
}

/// Whether a CUDA driver library loads, asked once per process: cudarc's loader panics
/// when none does, so it is only reached after this said yes.
fn driver_loads() -> bool {
    static LOADS: OnceLock<bool> = OnceLock::new();
    // SAFETY: cudarc's check only dlopens the driver library by the names cudarc searches
    // (and closes it); loading libcuda runs its initialisers, as every CUDA program does.
    *LOADS.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Entry point `name` of the driver cudarc's loader opened (the first of its search order
/// that opens: the stand-in driver on `LD_LIBRARY_PATH` is found as the real one is), as
/// a function of type `F`.
///
/// # Safety
/// `F` must be the entry point's C signature (with integer return and integer or plain
/// struct out-parameters).
unsafe fn resolve<F: Copy>(name: &'static str) -> Result<F, String> {
    if !driver_loads() {
        return Err("no CUDA driver library (libcuda.so) loads on this machine".to_string());
    }
    // SAFETY: a library opens (checked above), so cudarc's loader does not panic; it keeps
    // the library loaded for the life of the process, so the symbol stays valid.
    let library = unsafe { cudarc::driver::sys::culib() };
    // SAFETY: the caller vouches for `F`; the pointer is only copied out.
    match unsafe { library.get::<F>(name.as_bytes()) } {
        Ok(symbol) => Ok(*symbol),
        Err(e) => Err(format!(
            "the CUDA driver does not export {name} (older than the entry point?): {e}"
        )),
    }
}

/// Declares each entry point: a function of the same name that resolves it on first use
/// and calls it, answering the raw code. `ENTRY_POINTS` lists them all.
macro_rules! entry_points {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        /// Every entry point this layer can resolve, by the name it resolves.
        pub const ENTRY_POINTS: &[&str] = &[$(stringify!($name)),*];

        $(
            $(#[$doc])*
            ///
            /// # Safety
            /// The arguments must be what CUDA documents for this entry point: live
            /// handles, pointers valid for what the driver reads and writes through them.
            #[allow(non_snake_case, clippy::too_many_arguments)]
            pub unsafe fn $name($($arg: $ty),*) -> Answer {
                type Signature = unsafe extern "C" fn($($ty),*) -> RawResult;
                static RESOLVED: OnceLock<Result<Signature, String>> = OnceLock::new();
                let resolved = RESOLVED.get_or_init(|| {
                    // SAFETY: `Signature` is the entry point's C signature, as declared here
                    // from CUDA's cuda.h, with the return type an integer.
                    unsafe { resolve::<Signature>(stringify!($name)) }
                });
                let code = match resolved {
                    // SAFETY: forwarded to the caller (the arguments); the function is the
                    // driver's own, resolved by its name.
                    Ok(function) => Ok(unsafe { function($($arg),*) }),
                    Err(reason) => Err(reason.clone()),
                };
                Answer { call: stringify!($name), code }
            }
        )*
    };
}

entry_points! {
    // ---- errors ----
    /// The name of a `CUresult` (`CUDA_ERROR_INVALID_VALUE` for a code the driver does
    /// not define).
    fn cuGetErrorName(error: RawResult, name: *mut *const c_char);
    /// The description of a `CUresult` (as `cuGetErrorName` for an unknown one).
    fn cuGetErrorString(error: RawResult, text: *mut *const c_char);

    // ---- the probe ----
    fn cuDriverGetVersion(version: *mut c_int);
    fn cuInit(flags: c_uint);
    fn cuDeviceGetCount(count: *mut c_int);
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int);
    fn cuDeviceGetName(name: *mut c_char, length: c_int, device: CUdevice);
    fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, device: CUdevice);
    fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice);
    /// `attribute` is a `CUdevice_attribute` value, passed as the integer it is.
    fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_int, device: CUdevice);

    // ---- contexts ----
    fn cuDevicePrimaryCtxRetain(context: *mut CUcontext, device: CUdevice);
    fn cuDevicePrimaryCtxRelease_v2(device: CUdevice);
    fn cuDevicePrimaryCtxReset_v2(device: CUdevice);
    fn cuDevicePrimaryCtxGetState(device: CUdevice, flags: *mut c_uint, active: *mut c_int);
    fn cuCtxGetCurrent(context: *mut CUcontext);
    fn cuCtxSetCurrent(context: CUcontext);
    fn cuCtxSetFlags(flags: c_uint);
    fn cuCtxGetFlags(flags: *mut c_uint);
    fn cuCtxSynchronize();
    fn cuCtxCreate_v2(context: *mut CUcontext, flags: c_uint, device: CUdevice);
    fn cuCtxDestroy_v2(context: CUcontext);
    fn cuCtxPushCurrent_v2(context: CUcontext);
    fn cuCtxPopCurrent_v2(context: *mut CUcontext);

    // ---- modules ----
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void);
    fn cuModuleGetFunction(function: *mut CUfunction, module: CUmodule, name: *const c_char);
    fn cuModuleUnload(module: CUmodule);

    // ---- streams ----
    fn cuStreamCreate(stream: *mut CUstream, flags: c_uint);
    fn cuStreamSynchronize(stream: CUstream);
    /// Whether the stream's work has all run, without waiting: `SUCCESS`, or
    /// `CUDA_ERROR_NOT_READY`, or the context's sticky error.
    fn cuStreamQuery(stream: CUstream);
    fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint);
    fn cuStreamDestroy_v2(stream: CUstream);

    // ---- events ----
    fn cuEventCreate(event: *mut CUevent, flags: c_uint);
    fn cuEventRecord(event: CUevent, stream: CUstream);
    fn cuEventSynchronize(event: CUevent);
    /// CUDA 12.8 added `cuEventElapsedTime_v2`; celer's floor (12.2) has only this one.
    fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent);
    fn cuEventDestroy_v2(event: CUevent);

    // ---- device memory ----
    /// Stream-ordered allocation, where the device supports memory pools.
    fn cuMemAllocAsync(pointer: *mut CUdeviceptr, bytes: usize, stream: CUstream);
    fn cuMemFreeAsync(pointer: CUdeviceptr, stream: CUstream);
    /// Where the device has no memory pools.
    fn cuMemAlloc_v2(pointer: *mut CUdeviceptr, bytes: usize);
    fn cuMemFree_v2(pointer: CUdeviceptr);
    fn cuMemsetD8Async(pointer: CUdeviceptr, value: u8, bytes: usize, stream: CUstream);
    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream);
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream);
    fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream);
    /// Synchronous: complete when it returns.
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize);

    // ---- page-locked host memory ----
    fn cuMemHostAlloc(pointer: *mut *mut c_void, bytes: usize, flags: c_uint);
    fn cuMemFreeHost(pointer: *mut c_void);
    fn cuMemHostRegister_v2(pointer: *mut c_void, bytes: usize, flags: c_uint);
    fn cuMemHostUnregister(pointer: *mut c_void);

    // ---- launches ----
    fn cuLaunchKernel(
        function: CUfunction,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    );
}
