//! Which NVIDIA GPUs this machine has, asked of the CUDA driver (libcuda.so.1, opened at
//! run time, so a CPU-only machine just finds none), and making one of them current on
//! a thread so that TensorRT builds or loads engines for it. A deliberately small probe
//! for `celer build` and the engine check: the cuda module owns devices once it lands,
//! and this should then move there (or call it).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use super::manifest::GpuIdentity;

/// Overrides where libcuda is looked for (e.g. a compat library, or a test forcing the
/// CPU path with a path that does not exist).
pub const LIBCUDA_ENV: &str = "CELER_LIBCUDA_PATH";
const LIBCUDA: &str = "libcuda.so.1";

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NO_DEVICE: CuResult = 100;
const ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDevice {
    /// CUDA device ordinal (as in CUDA_VISIBLE_DEVICES numbering).
    pub ordinal: u32,
    pub identity: GpuIdentity,
    pub total_memory_bytes: u64,
}

/// What the probe found. No GPU is a normal outcome, with the reason in `absent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInventory {
    pub devices: Vec<GpuDevice>,
    /// The driver's CUDA version, e.g. "12.8".
    pub driver_cuda_version: Option<String>,
    /// Why there is no GPU, when `devices` is empty.
    pub absent: Option<String>,
}

impl GpuInventory {
    /// The distinct GPU models (name + compute capability), each with its ordinals:
    /// an engine is built once per model and shared by its devices.
    pub fn distinct(&self) -> Vec<(GpuIdentity, Vec<u32>)> {
        let mut groups: Vec<(GpuIdentity, Vec<u32>)> = Vec::new();
        for device in &self.devices {
            match groups.iter_mut().find(|(id, _)| *id == device.identity) {
                Some((_, ordinals)) => ordinals.push(device.ordinal),
                None => groups.push((device.identity.clone(), vec![device.ordinal])),
            }
        }
        groups
    }
}

/// The driver entry points used here, resolved once.
struct Driver {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    /// Keeps the library mapped for as long as the function pointers above live (the
    /// whole process: this sits in a static).
    _library: libloading::Library,
}

fn driver() -> Result<&'static Driver, String> {
    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let path = std::env::var_os(LIBCUDA_ENV).unwrap_or_else(|| LIBCUDA.into());
            // SAFETY: libcuda's initialisers have no preconditions; it is the NVIDIA
            // driver's user-space library, loaded as every CUDA program loads it.
            let library = unsafe { libloading::Library::new(&path) }.map_err(|e| {
                format!(
                    "no NVIDIA driver: {} cannot be loaded: {}",
                    path.to_string_lossy(),
                    with_source(&e)
                )
            })?;
            /// Resolves `name` as a function pointer of type `T`.
            ///
            /// # Safety
            /// `T` must be the C signature of `name` in the CUDA driver API.
            unsafe fn get<T: Copy>(library: &libloading::Library, name: &str) -> Result<T, String> {
                // SAFETY: the caller's contract on T.
                unsafe { library.get::<T>(name.as_bytes()) }
                    .map(|symbol| *symbol)
                    .map_err(|e| {
                        format!(
                            "the NVIDIA driver library has no {name}: {}",
                            with_source(&e)
                        )
                    })
            }
            // SAFETY: each signature below is the driver API's (cuda.h, CUDA 11 and later).
            unsafe {
                let driver = Driver {
                    init: get(&library, "cuInit")?,
                    driver_get_version: get(&library, "cuDriverGetVersion")?,
                    device_get_count: get(&library, "cuDeviceGetCount")?,
                    device_get: get(&library, "cuDeviceGet")?,
                    device_get_name: get(&library, "cuDeviceGetName")?,
                    device_get_attribute: get(&library, "cuDeviceGetAttribute")?,
                    device_total_mem: get(&library, "cuDeviceTotalMem_v2")?,
                    primary_ctx_retain: get(&library, "cuDevicePrimaryCtxRetain")?,
                    primary_ctx_release: get(&library, "cuDevicePrimaryCtxRelease_v2")?,
                    ctx_set_current: get(&library, "cuCtxSetCurrent")?,
                    _library: library,
                };
                match (driver.init)(0) {
                    CUDA_SUCCESS => Ok(driver),
                    CUDA_ERROR_NO_DEVICE => Err("the NVIDIA driver reports no CUDA device".into()),
                    code => Err(format!("cuInit failed with CUDA error {code}")),
                }
            }
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// libloading's errors keep dlerror()'s text in their source.
fn with_source(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}

/// Lists the GPUs. Never fails: when the driver is missing or broken, the inventory is
/// empty and says why.
pub fn probe() -> GpuInventory {
    match list_devices() {
        Ok((devices, version)) => {
            let absent = devices
                .is_empty()
                .then(|| "the NVIDIA driver reports no CUDA device".to_string());
            GpuInventory {
                devices,
                driver_cuda_version: Some(version),
                absent,
            }
        }
        Err(reason) => GpuInventory {
            devices: Vec::new(),
            driver_cuda_version: None,
            absent: Some(reason),
        },
    }
}

fn list_devices() -> Result<(Vec<GpuDevice>, String), String> {
    let d = driver()?;
    let call = |what: &str, code: CuResult| {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what} failed with CUDA error {code}"))
        }
    };
    let (mut version, mut count) = (0, 0);
    // SAFETY: the driver is initialised; the out pointers are valid.
    unsafe {
        call("cuDriverGetVersion", (d.driver_get_version)(&mut version))?;
        call("cuDeviceGetCount", (d.device_get_count)(&mut count))?;
    }
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let mut device = 0;
        let mut name = [0 as c_char; 256];
        let (mut major, mut minor, mut memory) = (0, 0, 0usize);
        // SAFETY: `ordinal` < count; the out pointers are valid and `name` holds the
        // 256 bytes announced.
        unsafe {
            call("cuDeviceGet", (d.device_get)(&mut device, ordinal))?;
            call(
                "cuDeviceGetName",
                (d.device_get_name)(name.as_mut_ptr(), name.len() as c_int, device),
            )?;
            call(
                "cuDeviceGetAttribute",
                (d.device_get_attribute)(&mut major, ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
            )?;
            call(
                "cuDeviceGetAttribute",
                (d.device_get_attribute)(&mut minor, ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
            )?;
            call(
                "cuDeviceTotalMem",
                (d.device_total_mem)(&mut memory, device),
            )?;
        }
        // SAFETY: the driver NUL-terminates the name within the buffer.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .trim()
            .to_string();
        devices.push(GpuDevice {
            ordinal: ordinal as u32,
            identity: GpuIdentity {
                name,
                compute_capability: format!("{major}.{minor}"),
            },
            total_memory_bytes: memory as u64,
        });
    }
    Ok((
        devices,
        format!("{}.{}", version / 1000, (version % 1000) / 10),
    ))
}

/// A GPU's primary context, current on the thread that bound it until dropped. TensorRT
/// (through the CUDA runtime inside it) uses the context current on the calling thread.
pub struct DeviceBinding {
    device: CuDevice,
    driver: &'static Driver,
    /// Not Send: the binding is a property of the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Makes GPU `ordinal`'s primary context current on this thread.
pub fn bind_device(ordinal: u32) -> Result<DeviceBinding, String> {
    let d = driver()?;
    let mut device = 0;
    let mut context: CuContext = std::ptr::null_mut();
    // SAFETY: the driver is initialised; the out pointers are valid.
    unsafe {
        let code = (d.device_get)(&mut device, ordinal as c_int);
        if code != CUDA_SUCCESS {
            return Err(format!("no CUDA device {ordinal} (CUDA error {code})"));
        }
        let code = (d.primary_ctx_retain)(&mut context, device);
        if code != CUDA_SUCCESS {
            return Err(format!(
                "cannot retain the context of CUDA device {ordinal} (CUDA error {code})"
            ));
        }
        let code = (d.ctx_set_current)(context);
        if code != CUDA_SUCCESS {
            (d.primary_ctx_release)(device);
            return Err(format!(
                "cannot make CUDA device {ordinal} current (CUDA error {code})"
            ));
        }
    }
    Ok(DeviceBinding {
        device,
        driver: d,
        _not_send: std::marker::PhantomData,
    })
}

impl Drop for DeviceBinding {
    fn drop(&mut self) {
        // SAFETY: undoes bind_device on the same thread (the type is not Send). Errors
        // are ignored: there is nothing useful to do with them while dropping.
        unsafe {
            (self.driver.ctx_set_current)(std::ptr::null_mut());
            (self.driver.primary_ctx_release)(self.device);
        }
    }
}
