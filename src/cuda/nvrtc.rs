//! NVRTC, the run-time CUDA C compiler, loaded from a file path rather than through
//! cudarc, whose search is by name only and panics when the library is absent; here a
//! missing library is an error value. Compiles to CUBIN for one real architecture
//! (`sm_XY`), so the driver never JIT-compiles PTX (PTX only for tests that read which
//! instructions the kernels became).
//!
//! A CUBIN loads on a driver of its NVRTC's CUDA version or a newer one, so a process may
//! hold several NVRTCs and use, for each driver, the newest that is not newer than it
//! ([`Nvrtc::for_driver`]): the `nvidia-cuda-nvrtc` (13) and `nvidia-cuda-nvrtc-cu12`
//! (12.2, celer's floor) wheels in `.venv`, or `CELER_NVRTC_PATH`, else the system's
//! `libnvrtc.so.13` and `libnvrtc.so.12`. The entry points used here are the same in
//! NVRTC 12 and 13.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::arch::Arch;
use super::probe::{CudaVersion, DRIVER_FLOOR};
use super::CudaError;

/// The wheels' layouts under a virtual environment's `site-packages`: NVRTC 13
/// (`nvidia-cuda-nvrtc`) and NVRTC 12 (`nvidia-cuda-nvrtc-cu12`).
const VENV_NVRTCS: [&str; 2] = [
    "site-packages/nvidia/cu13/lib/libnvrtc.so.13",
    "site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
];
/// Names tried through the dynamic loader's own search when no wheel has that major.
/// NVRTC 12 has every entry point of [`Api`] with the same signatures.
const SYSTEM_NAMES: [&str; 2] = ["libnvrtc.so.13", "libnvrtc.so.12"];

type Program = *mut c_void;
type NvrtcResult = c_int;

/// The entry points celer uses, resolved once when the library loads.
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    num_supported_archs: unsafe extern "C" fn(*mut c_int) -> NvrtcResult,
    supported_archs: unsafe extern "C" fn(*mut c_int) -> NvrtcResult,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    program_log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    program_log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    destroy_program: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
    error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
}

/// A loaded NVRTC. Process-wide: [`Nvrtc::all`] loads every one found, once.
pub struct Nvrtc {
    api: Api,
    path: String,
    version: CudaVersion,
    // Keeps the code behind `api` mapped; never unloaded (NVRTC keeps global state).
    _library: libloading::Library,
}

/// What a compile produces: a CUBIN for a real architecture, or PTX for its virtual one.
#[derive(Debug, Clone, Copy)]
enum Output {
    Cubin,
    Ptx,
}

/// One source file of a program: NVRTC compiles `source` as `name`, with `headers`
/// resolvable by `#include "<name>"`.
pub struct Source<'a> {
    pub name: &'a str,
    pub text: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
}

impl Nvrtc {
    /// Every NVRTC found, newest first, loaded on first use; the error says where it
    /// looked.
    pub fn all() -> Result<&'static [Nvrtc], CudaError> {
        static NVRTCS: OnceLock<Result<Vec<Nvrtc>, CudaError>> = OnceLock::new();
        NVRTCS
            .get_or_init(Self::load_all)
            .as_deref()
            .map_err(Clone::clone)
    }

    /// The newest NVRTC found: for compiling ahead of time and for tests, where no driver
    /// decides.
    pub fn get() -> Result<&'static Nvrtc, CudaError> {
        Self::all().map(|all| &all[0])
    }

    /// The NVRTC whose CUBINs `driver` loads: the newest found that is not newer than the
    /// driver. The error names what was found and what to install.
    pub fn for_driver(driver: CudaVersion) -> Result<&'static Nvrtc, CudaError> {
        let all = Self::all()?;
        all.iter().find(|n| n.version <= driver).ok_or_else(|| {
            let found: Vec<String> = all
                .iter()
                .map(|n| format!("NVRTC {} ({})", n.version, n.path))
                .collect();
            CudaError::NvrtcMissing(format!(
                "no NVRTC for this CUDA {driver} driver: a CUBIN loads on a driver of its \
                 NVRTC's version or newer, and only {} was found. Install NVRTC \
                 {DRIVER_FLOOR} (`make python` puts the nvidia-cuda-nvrtc-cu12 wheel in \
                 .venv), set CELER_NVRTC_PATH to an NVRTC no newer than the driver, or ship \
                 kernels compiled by one (CELER_KERNEL_DIR, `celer kernels`)",
                found.join(" and ")
            ))
        })
    }

    fn load_all() -> Result<Vec<Nvrtc>, CudaError> {
        let mut tried = Vec::new();
        let mut loaded: Vec<Nvrtc> = Vec::new();
        for candidate in library_candidates() {
            // SAFETY: loading a shared library runs its initialisers; libnvrtc's only set
            // up its own state. The library stays loaded for the life of the process.
            match unsafe { libloading::Library::new(&candidate) } {
                Ok(library) => {
                    let nvrtc = Self::from_library(library, &candidate)?;
                    // One per version: a system name may find the wheel's library again.
                    if !loaded.iter().any(|n| n.version == nvrtc.version) {
                        loaded.push(nvrtc);
                    }
                }
                Err(e) => tried.push(format!("{} ({e})", candidate.display())),
            }
        }
        if loaded.is_empty() {
            return Err(CudaError::NvrtcMissing(format!(
                "libnvrtc not found; tried {}. Run `make python` (installs the nvidia-cuda-nvrtc \
                 wheels into .venv) or set CELER_NVRTC_PATH to libnvrtc.so.13 or libnvrtc.so.12",
                tried.join(", ")
            )));
        }
        loaded.sort_by_key(|n| std::cmp::Reverse(n.version));
        Ok(loaded)
    }

    fn from_library(library: libloading::Library, path: &Path) -> Result<Nvrtc, CudaError> {
        let api = resolve(&library, path)?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are valid for writes of one c_int.
        let status = unsafe { (api.version)(&mut major, &mut minor) };
        if status != 0 {
            return Err(CudaError::NvrtcUnusable {
                path: path.to_path_buf(),
                reason: format!("nvrtcVersion failed ({status})"),
            });
        }
        Ok(Nvrtc {
            api,
            path: path.display().to_string(),
            version: CudaVersion::new(major.max(0) as u32, minor.max(0) as u32),
            _library: library,
        })
    }

    /// The file or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC's CUDA version: its CUBINs need a driver of this version or newer.
    pub fn version(&self) -> CudaVersion {
        self.version
    }

    /// The real architectures this NVRTC can compile for, ascending.
    pub fn supported_archs(&self) -> Result<Vec<Arch>, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is valid for a write of one c_int.
        self.check(unsafe { (self.api.num_supported_archs)(&mut n) })?;
        let mut raw = vec![0 as c_int; n.max(0) as usize];
        // SAFETY: `raw` holds exactly the count NVRTC just reported.
        self.check(unsafe { (self.api.supported_archs)(raw.as_mut_ptr()) })?;
        Ok(raw
            .into_iter()
            .map(|v| Arch::new(v as u32 / 10, v as u32 % 10))
            .collect())
    }

    /// Compiles `source` to a CUBIN for `arch` with `options` (plus the architecture).
    /// A compile error carries NVRTC's log.
    pub fn compile_cubin(
        &self,
        source: &Source<'_>,
        arch: Arch,
        options: &[&str],
    ) -> Result<Vec<u8>, CudaError> {
        self.compile(source, arch, Output::Cubin, options)
    }

    /// Compiles `source` to PTX for the virtual architecture of `arch` (`compute_XY`)
    /// with `options`: the instructions NVRTC chose, in text, for tests that read them
    /// (which types the kernels compute in). Serving loads CUBINs only.
    pub fn compile_ptx(
        &self,
        source: &Source<'_>,
        arch: Arch,
        options: &[&str],
    ) -> Result<String, CudaError> {
        let ptx = self.compile(source, arch, Output::Ptx, options)?;
        // NUL-terminated text.
        let end = ptx.iter().position(|&b| b == 0).unwrap_or(ptx.len());
        Ok(String::from_utf8_lossy(&ptx[..end]).into_owned())
    }

    fn compile(
        &self,
        source: &Source<'_>,
        arch: Arch,
        output: Output,
        options: &[&str],
    ) -> Result<Vec<u8>, CudaError> {
        let cstr = |s: &str| {
            CString::new(s).map_err(|_| CudaError::Compile {
                arch,
                file: source.name.to_string(),
                log: format!("{s:?} contains a NUL byte"),
            })
        };
        let text = cstr(source.text)?;
        let name = cstr(source.name)?;
        let header_texts = source
            .headers
            .iter()
            .map(|(_, t)| cstr(t))
            .collect::<Result<Vec<_>, _>>()?;
        let header_names = source
            .headers
            .iter()
            .map(|(n, _)| cstr(n))
            .collect::<Result<Vec<_>, _>>()?;
        let header_text_ptrs: Vec<*const c_char> =
            header_texts.iter().map(|c| c.as_ptr()).collect();
        let header_name_ptrs: Vec<*const c_char> =
            header_names.iter().map(|c| c.as_ptr()).collect();
        let target = match output {
            Output::Cubin => arch.sm(),
            Output::Ptx => format!("compute_{}{}", arch.major, arch.minor),
        };
        let mut all_options = vec![cstr(&format!("--gpu-architecture={target}"))?];
        for option in options {
            all_options.push(cstr(option)?);
        }
        let option_ptrs: Vec<*const c_char> = all_options.iter().map(|c| c.as_ptr()).collect();

        let mut program: Program = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string owned above; the header
        // arrays have `headers.len()` entries each.
        self.check(unsafe {
            (self.api.create_program)(
                &mut program,
                text.as_ptr(),
                name.as_ptr(),
                header_text_ptrs.len() as c_int,
                header_text_ptrs.as_ptr(),
                header_name_ptrs.as_ptr(),
            )
        })?;
        let program = ProgramGuard {
            nvrtc: self,
            program,
        };
        // SAFETY: `program` was created above; the options outlive the call.
        let status = unsafe {
            (self.api.compile_program)(
                program.program,
                option_ptrs.len() as c_int,
                option_ptrs.as_ptr(),
            )
        };
        if status != 0 {
            let log = self.log(program.program).unwrap_or_default();
            return Err(CudaError::Compile {
                arch,
                file: source.name.to_string(),
                log: format!("{}: {log}", self.describe(status)),
            });
        }
        let (size_of, copy) = match output {
            Output::Cubin => (self.api.cubin_size, self.api.cubin),
            Output::Ptx => (self.api.ptx_size, self.api.ptx),
        };
        let mut size = 0usize;
        // SAFETY: the program compiled; `size` is valid for a write.
        self.check(unsafe { size_of(program.program, &mut size) })?;
        let mut bytes = vec![0u8; size];
        // SAFETY: `bytes` holds the `size` bytes NVRTC reported.
        self.check(unsafe { copy(program.program, bytes.as_mut_ptr().cast()) })?;
        Ok(bytes)
    }

    fn log(&self, program: Program) -> Option<String> {
        let mut size = 0usize;
        // SAFETY: `program` is live; `size` is valid for a write.
        if unsafe { (self.api.program_log_size)(program, &mut size) } != 0 {
            return None;
        }
        let mut log = vec![0u8; size.max(1)];
        // SAFETY: `log` holds the `size` bytes NVRTC reported (NUL included).
        if unsafe { (self.api.program_log)(program, log.as_mut_ptr().cast()) } != 0 {
            return None;
        }
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        Some(String::from_utf8_lossy(&log[..end]).trim().to_string())
    }

    fn describe(&self, status: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string for any status value.
        let text = unsafe { (self.api.error_string)(status) };
        if text.is_null() {
            return format!("NVRTC error {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    fn check(&self, status: NvrtcResult) -> Result<(), CudaError> {
        if status == 0 {
            Ok(())
        } else {
            Err(CudaError::Nvrtc(self.describe(status)))
        }
    }
}

/// Destroys the program on every path out of `compile`.
struct ProgramGuard<'a> {
    nvrtc: &'a Nvrtc,
    program: Program,
}

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        // A failure here leaks a program; there is nothing better to do in a destructor.
        let _ = unsafe { (self.nvrtc.api.destroy_program)(&mut self.program) };
    }
}

/// The entry points of `library`, loaded from `path`.
fn resolve(library: &libloading::Library, path: &Path) -> Result<Api, CudaError> {
    // SAFETY: each symbol is looked up by its documented NVRTC name and given the
    // signature of nvrtc.h (NVRTC 11 and later).
    unsafe {
        Ok(Api {
            version: *symbol(library, b"nvrtcVersion\0", path)?,
            num_supported_archs: *symbol(library, b"nvrtcGetNumSupportedArchs\0", path)?,
            supported_archs: *symbol(library, b"nvrtcGetSupportedArchs\0", path)?,
            create_program: *symbol(library, b"nvrtcCreateProgram\0", path)?,
            compile_program: *symbol(library, b"nvrtcCompileProgram\0", path)?,
            program_log_size: *symbol(library, b"nvrtcGetProgramLogSize\0", path)?,
            program_log: *symbol(library, b"nvrtcGetProgramLog\0", path)?,
            cubin_size: *symbol(library, b"nvrtcGetCUBINSize\0", path)?,
            cubin: *symbol(library, b"nvrtcGetCUBIN\0", path)?,
            ptx_size: *symbol(library, b"nvrtcGetPTXSize\0", path)?,
            ptx: *symbol(library, b"nvrtcGetPTX\0", path)?,
            destroy_program: *symbol(library, b"nvrtcDestroyProgram\0", path)?,
            error_string: *symbol(library, b"nvrtcGetErrorString\0", path)?,
        })
    }
}

/// Symbol `name` (NUL-terminated) of `library`, loaded from `path`.
///
/// # Safety
/// `T` must be the function pointer type of the symbol `name`.
unsafe fn symbol<'l, T>(
    library: &'l libloading::Library,
    name: &[u8],
    path: &Path,
) -> Result<libloading::Symbol<'l, T>, CudaError> {
    // SAFETY: forwarded to the caller.
    unsafe { library.get::<T>(name) }.map_err(|e| CudaError::NvrtcUnusable {
        path: path.to_path_buf(),
        reason: format!(
            "missing symbol {}: {e}",
            String::from_utf8_lossy(&name[..name.len() - 1])
        ),
    })
}

/// Where to look: `CELER_NVRTC_PATH` alone when set; else the wheels in the first `.venv`
/// (of the checkout holding the working directory or the executable) that has any, then
/// the loader's search by name.
fn library_candidates() -> Vec<PathBuf> {
    if let Some(path) = std::env::var_os("CELER_NVRTC_PATH") {
        return vec![PathBuf::from(path)];
    }
    let mut candidates: Vec<PathBuf> = crate::host::wheels::venvs()
        .map(|venv| find_in_venv(&venv))
        .find(|found| !found.is_empty())
        .unwrap_or_default();
    candidates.extend(SYSTEM_NAMES.iter().map(PathBuf::from));
    candidates
}

fn find_in_venv(venv: &Path) -> Vec<PathBuf> {
    let Ok(pythons) = std::fs::read_dir(venv.join("lib")) else {
        return Vec::new();
    };
    let pythons: Vec<PathBuf> = pythons.flatten().map(|p| p.path()).collect();
    VENV_NVRTCS
        .iter()
        .filter_map(|wheel| {
            pythons
                .iter()
                .map(|python| python.join(wheel))
                .find(|p| p.is_file())
        })
        .collect()
}
