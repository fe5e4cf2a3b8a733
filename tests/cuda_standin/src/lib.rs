//! celer's stand-in CUDA driver, for the tests: a `libcuda.so.1` (built by build.rs from
//! driver/ and the kernels' `.cu` sources) that cudarc loads as it loads the real driver,
//! and that runs celer's kernels on the CPU with a GPU's rules (driver/driver.cpp says
//! which). This crate only says where the library is and reaches its test controls.
//!
//! Two ways in:
//! - another process: start it with [`library_dir`] on `LD_LIBRARY_PATH`; cudarc's search
//!   by name finds the stand-in first (the directory has `libcuda.so` and `libcuda.so.1`);
//! - this process: [`StandIn::load`] before the first CUDA call; cudarc's later
//!   `dlopen("libcuda.so.1")` then finds it already loaded, by its soname.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::Path;
use std::sync::OnceLock;

/// The built library.
pub const LIBRARY: &str = env!("CELER_CUDA_STANDIN_LIBRARY");

/// The test kernels with planted bugs (tests/standin_catches.rs), as NVRTC compiles them.
pub const PLANTED_KERNELS: &str = include_str!("../kernels/planted.cu");

/// The directory to put on `LD_LIBRARY_PATH` of a process that should use the stand-in.
pub fn library_dir() -> &'static Path {
    Path::new(LIBRARY)
        .parent()
        .expect("the library path has a directory")
}

/// A fault to arm for a coming launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `cuLaunchKernel` returns CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES; the context stays usable.
    LaunchFails,
    /// The launch faults when it runs: CUDA_ERROR_ILLEGAL_ADDRESS, sticky, as a kernel's
    /// out-of-bounds access on a GPU.
    StickyError,
}

/// The stand-in, loaded into this process.
pub struct StandIn {
    last_error: unsafe extern "C" fn() -> *const c_char,
    clear_last_error: unsafe extern "C" fn(),
    inject: unsafe extern "C" fn(c_int, u64),
    counter: unsafe extern "C" fn(*const c_char) -> u64,
    _library: libloading::Library,
}

impl StandIn {
    /// Loads the stand-in (once per process). Call before anything else loads a CUDA
    /// driver: cudarc keeps the first one it finds for the life of the process.
    pub fn load() -> Result<&'static StandIn, String> {
        static LOADED: OnceLock<Result<StandIn, String>> = OnceLock::new();
        LOADED
            .get_or_init(|| {
                // SAFETY: loading the stand-in runs no initialiser beyond its kernels'
                // registration (static tables); the library stays loaded for the process.
                let library = unsafe { libloading::Library::new(LIBRARY) }
                    .map_err(|e| format!("cannot load the stand-in driver {LIBRARY}: {e}"))?;
                // SAFETY: each symbol is one of the stand-in's controls, declared in
                // driver/driver.cpp with exactly these C signatures.
                unsafe {
                    Ok(StandIn {
                        last_error: *library
                            .get(b"celer_standin_last_error\0")
                            .map_err(|e| e.to_string())?,
                        clear_last_error: *library
                            .get(b"celer_standin_clear_last_error\0")
                            .map_err(|e| e.to_string())?,
                        inject: *library
                            .get(b"celer_standin_inject\0")
                            .map_err(|e| e.to_string())?,
                        counter: *library
                            .get(b"celer_standin_counter\0")
                            .map_err(|e| e.to_string())?,
                        _library: library,
                    })
                }
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The details of the last error the stand-in reported ("" when none): which call,
    /// which kernel and parameter, which address, which lane.
    pub fn last_error(&self) -> String {
        // SAFETY: returns a NUL-terminated string owned by the calling thread, valid
        // until its next call on this thread; copied at once.
        unsafe { CStr::from_ptr((self.last_error)()) }
            .to_string_lossy()
            .into_owned()
    }

    pub fn clear_last_error(&self) {
        // SAFETY: no arguments; resets a string under the stand-in's lock.
        unsafe { (self.clear_last_error)() }
    }

    /// Arms `fault` for the `nth` launch from now (1: the next one).
    pub fn inject(&self, fault: Fault, nth: u64) {
        let kind = match fault {
            Fault::LaunchFails => 0,
            Fault::StickyError => 1,
        };
        // SAFETY: plain values; the stand-in stores them in atomics.
        unsafe { (self.inject)(kind, nth) }
    }

    /// A counter of the stand-in: `launches_run`, `htod_copies`, `dtoh_copies`,
    /// `contexts_created`, `sticky_errors`, `device_bytes`, ... (see driver.cpp).
    pub fn counter(&self, name: &str) -> u64 {
        let name = CString::new(name).expect("counter names have no NUL");
        // SAFETY: a NUL-terminated name that outlives the call.
        unsafe { (self.counter)(name.as_ptr()) }
    }
}
