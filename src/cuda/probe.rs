//! The device probe: is there a CUDA driver, which GPUs does it see, and what are they
//! (name, compute capability, memory, UUID, memory clock and bus width, hence peak memory
//! bandwidth). It checks that the driver library exists before any CUDA call, because
//! cudarc's loader (which `driver::sys` resolves through) panics on a machine without one;
//! it creates no context.

use super::driver::sys::CUdevice_attribute;
use super::driver::{self, Device, DriverError};
use serde::{Deserialize, Serialize};

use super::arch::Arch;
use super::CudaError;

/// Names the CUDA driver library for the probe; a path that does not exist hides the
/// driver (tests of the CPU path on a GPU machine; cudarc itself always loads the driver
/// by its soname).
pub const LIBCUDA_ENV: &str = "CELER_LIBCUDA_PATH";

/// A CUDA version, as the driver (`cuDriverGetVersion`) and NVRTC report theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CudaVersion {
    pub major: u32,
    pub minor: u32,
}

impl CudaVersion {
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// From `cuDriverGetVersion`'s encoding: 12020 is 12.2.
    pub fn from_driver(code: i32) -> Self {
        let code = code.max(0) as u32;
        Self::new(code / 1000, (code % 1000) / 10)
    }
}

impl std::fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The oldest CUDA driver celer runs on: CUDA 12.2, NVIDIA's R535 branch, what SageMaker's
/// inference AMIs of today offer. Everything celer calls exists there: `driver::sys`
/// resolves no newer entry point (`cuEventElapsedTime_v2` of 12.8 among them), kernels come from an NVRTC no newer than the driver
/// ([`crate::cuda::nvrtc::Nvrtc::for_driver`]), and the GPU image's TensorRT is its CUDA 12
/// build. An older driver is refused by the probe, before any other call.
pub const DRIVER_FLOOR: CudaVersion = CudaVersion::new(12, 2);

/// The NVIDIA driver branch of [`DRIVER_FLOOR`].
pub const DRIVER_FLOOR_BRANCH: &str = "R535";

/// Why a driver older than the floor is not used; what `celer serve` says.
pub fn below_floor(driver: CudaVersion) -> String {
    format!(
        "the CUDA driver is version {driver}, older than celer's floor, CUDA {DRIVER_FLOOR} \
         (NVIDIA driver {DRIVER_FLOOR_BRANCH} or newer): its GPUs are not used. Update the \
         driver; on SageMaker, set the endpoint's InferenceAmiVersion to one with driver \
         {DRIVER_FLOOR_BRANCH} or newer (README, \"GPU drivers\")"
    )
}

/// A GPU model as far as a plan cares: TensorRT picks kernels per model, so a plan is
/// tied to the name and compute capability of the GPU that built it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuIdentity {
    pub name: String,
    /// "major.minor", e.g. "9.0".
    pub compute_capability: String,
}

impl GpuIdentity {
    /// A folder name for this GPU model, e.g. `nvidia-h200-sm90`.
    pub fn key(&self) -> String {
        let mut slug = String::new();
        for c in self.name.chars() {
            if c.is_ascii_alphanumeric() {
                slug.push(c.to_ascii_lowercase());
            } else if !slug.ends_with('-') && !slug.is_empty() {
                slug.push('-');
            }
        }
        let slug = slug.trim_end_matches('-');
        let sm: String = self
            .compute_capability
            .chars()
            .filter(char::is_ascii_digit)
            .collect();
        format!("{slug}-sm{sm}")
    }
}

/// One GPU as the driver describes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (u32, u32),
    pub total_memory_bytes: u64,
    pub uuid: String,
    pub memory_clock_khz: u32,
    pub memory_bus_width_bits: u32,
    pub multiprocessors: u32,
}

impl GpuInfo {
    /// Peak memory bandwidth in bytes/s: two transfers per memory clock (DDR) across the
    /// bus. For HBM and GDDR the driver reports the clock so that this formula holds
    /// (an H100 SXM: 2619 MHz x 5120 bit x 2 / 8 = 3.35 TB/s).
    pub fn peak_bandwidth_bytes_per_s(&self) -> f64 {
        2.0 * f64::from(self.memory_clock_khz) * 1e3 * f64::from(self.memory_bus_width_bits) / 8.0
    }

    pub fn arch(&self) -> Arch {
        Arch::new(self.compute_capability.0, self.compute_capability.1)
    }

    /// The GPU as a TensorRT plan is tied to it: its name and compute capability.
    pub fn identity(&self) -> GpuIdentity {
        GpuIdentity {
            name: self.name.clone(),
            compute_capability: format!(
                "{}.{}",
                self.compute_capability.0, self.compute_capability.1
            ),
        }
    }
}

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Probe {
    /// No `libcuda.so` on this machine: the CPU path is the only one.
    NoDriver,
    /// The driver loaded but failed (no device, a driver/kernel-module mismatch, ...) or
    /// is older than [`DRIVER_FLOOR`]; `reason` is the `CudaError` that says which.
    DriverError { reason: String },
    /// The driver works; `gpus` may be empty.
    Ready {
        /// As the driver reports it, e.g. 13000 for CUDA 13.0.
        driver_version: i32,
        gpus: Vec<GpuInfo>,
    },
}

impl Probe {
    /// The GPUs found; none unless the driver is ready.
    pub fn gpus(&self) -> &[GpuInfo] {
        match self {
            Probe::Ready { gpus, .. } => gpus,
            _ => &[],
        }
    }

    /// The driver's CUDA version, e.g. "13.0".
    pub fn driver_cuda_version(&self) -> Option<String> {
        self.driver_version().map(|v| v.to_string())
    }

    /// The driver's CUDA version.
    pub fn driver_version(&self) -> Option<CudaVersion> {
        match self {
            Probe::Ready { driver_version, .. } => Some(CudaVersion::from_driver(*driver_version)),
            _ => None,
        }
    }

    /// The distinct GPU models (name + compute capability), each with its ordinals: an
    /// engine is built once per model and shared by its devices.
    pub fn distinct(&self) -> Vec<(GpuIdentity, Vec<u32>)> {
        let mut groups: Vec<(GpuIdentity, Vec<u32>)> = Vec::new();
        for gpu in self.gpus() {
            let identity = gpu.identity();
            match groups.iter_mut().find(|(id, _)| *id == identity) {
                Some((_, ordinals)) => ordinals.push(gpu.ordinal as u32),
                None => groups.push((identity, vec![gpu.ordinal as u32])),
            }
        }
        groups
    }

    /// One line for logs and reports.
    pub fn summary(&self) -> String {
        match self {
            Probe::NoDriver => "no CUDA driver".to_string(),
            // The error names the driver itself ("CUDA driver: ...", "the CUDA driver is
            // version ...").
            Probe::DriverError { reason } => reason.clone(),
            Probe::Ready { gpus, .. } => {
                let list: Vec<String> = gpus
                    .iter()
                    .map(|g| {
                        format!(
                            "#{} {} (sm_{}{}, {:.1} GiB, {:.0} GB/s peak)",
                            g.ordinal,
                            g.name,
                            g.compute_capability.0,
                            g.compute_capability.1,
                            g.total_memory_bytes as f64 / (1u64 << 30) as f64,
                            g.peak_bandwidth_bytes_per_s() / 1e9
                        )
                    })
                    .collect();
                format!(
                    "CUDA driver {}, {} GPU(s){}{}",
                    self.driver_cuda_version().unwrap_or_default(),
                    gpus.len(),
                    if gpus.is_empty() { "" } else { ": " },
                    list.join(", ")
                )
            }
        }
    }
}

/// Whether `libcuda` can be loaded. The one check that must precede every CUDA call.
/// `CELER_LIBCUDA_PATH` naming a file that does not exist hides the driver.
pub fn driver_present() -> bool {
    if let Some(path) = std::env::var_os(LIBCUDA_ENV) {
        if !std::path::Path::new(&path).exists() {
            return false;
        }
    }
    // SAFETY: cudarc's check only dlopens the driver library by name (and closes it);
    // loading libcuda runs its initialisers, which is what every CUDA program does.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Probes the driver and every GPU. Never panics: a machine without a driver is
/// `Probe::NoDriver`, a driver older than [`DRIVER_FLOOR`] a `Probe::DriverError` saying
/// so (and nothing but its version is asked of it).
pub fn probe() -> Probe {
    if !driver_present() {
        return Probe::NoDriver;
    }
    match enumerate() {
        Ok((driver_version, gpus)) => Probe::Ready {
            driver_version,
            gpus,
        },
        Err(error) => Probe::DriverError {
            reason: error.to_string(),
        },
    }
}

/// The driver's CUDA version; the driver must be present ([`driver_present`]).
pub fn driver_version() -> Result<CudaVersion, DriverError> {
    driver_code().map(CudaVersion::from_driver)
}

/// `cuDriverGetVersion`'s value, e.g. 12020: it may be called before `cuInit`, and every
/// driver has it.
fn driver_code() -> Result<i32, DriverError> {
    driver::driver_version()
}

fn enumerate() -> Result<(i32, Vec<GpuInfo>), CudaError> {
    let code = driver_code()?;
    let version = CudaVersion::from_driver(code);
    if version < DRIVER_FLOOR {
        return Err(CudaError::BelowFloor(version));
    }
    Ok((code, list_gpus()?))
}

fn list_gpus() -> Result<Vec<GpuInfo>, DriverError> {
    driver::init()?;
    (0..driver::device_count()?).map(describe).collect()
}

fn describe(ordinal: usize) -> Result<GpuInfo, DriverError> {
    use CUdevice_attribute as A;
    let dev = Device::get(ordinal)?;
    let attr = |a: A| dev.attribute(a).map(|v| v.max(0) as u32);
    Ok(GpuInfo {
        ordinal,
        name: dev.name()?,
        compute_capability: (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        total_memory_bytes: dev.total_memory()? as u64,
        uuid: format_uuid(&dev.uuid()?),
        memory_clock_khz: attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?,
        memory_bus_width_bits: attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
        multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
    })
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_versions_read_and_compare_as_cuda_writes_them() {
        assert_eq!(CudaVersion::from_driver(12020), CudaVersion::new(12, 2));
        assert_eq!(CudaVersion::from_driver(13000).to_string(), "13.0");
        assert_eq!(CudaVersion::from_driver(12080).to_string(), "12.8");
        assert!(CudaVersion::from_driver(11080) < DRIVER_FLOOR);
        assert!(CudaVersion::new(12, 10) > CudaVersion::new(12, 9));
        assert!(CudaVersion::new(13, 0) > CudaVersion::new(12, 9));
        let refusal = below_floor(CudaVersion::new(11, 8));
        assert!(refusal.contains("11.8") && refusal.contains("12.2") && refusal.contains("R535"));
    }

    #[test]
    fn uuid_prints_like_nvidia_smi() {
        let bytes: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(
            format_uuid(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }

    #[test]
    fn peak_bandwidth_of_an_h100_sxm() {
        let gpu = GpuInfo {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            total_memory_bytes: 80 << 30,
            uuid: String::new(),
            memory_clock_khz: 2_619_000,
            memory_bus_width_bits: 5120,
            multiprocessors: 132,
        };
        let tb_s = gpu.peak_bandwidth_bytes_per_s() / 1e12;
        assert!((tb_s - 3.352).abs() < 0.001, "{tb_s}");
    }
}
