//! The CUDA C kernels (`kernels/*.cu`, embedded in the binary) and their compilation: one
//! CUBIN per file per GPU architecture, compiled once per process and architecture and
//! shared by every device and replica of that architecture, and kept in a disk cache so
//! that a restart (or a machine without NVRTC) loads them without compiling. A read-only
//! folder shipped with the build (`CELER_KERNEL_DIR`, filled by `celer kernels`; the GPU
//! image's `/opt/celer/kernels`) is read first.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::arch::Arch;
use super::nvrtc::{Nvrtc, Source};
use super::probe::CudaVersion;
use super::CudaError;

/// One `.cu` file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// The header every file includes.
pub const COMMON_HEADER: (&str, &str) = ("common.cuh", include_str!("kernels/common.cuh"));

pub const PREPROCESS: KernelFile = KernelFile {
    name: "preprocess.cu",
    source: include_str!("kernels/preprocess.cu"),
    kernels: &[
        "resize_rgb8_horizontal",
        "resize_rgb8_vertical",
        "resize_rgb8_vertical_luma",
        "normalize_rgb8_f32",
        "normalize_rgb8_f16",
        "resize_rgb8_vertical_normalize_f32",
        "resize_rgb8_vertical_normalize_f16",
    ],
};

pub const TRIMAP: KernelFile = KernelFile {
    name: "trimap.cu",
    source: include_str!("kernels/trimap.cu"),
    kernels: &[
        "mask_minmax_init",
        "mask_minmax",
        "probability_trimap",
        "classes_trimap",
        "erode_rows",
        "erode_columns",
        "resize_nearest_u8",
        "trimap_to_unit_f32",
        "trimap_to_unit_f16",
    ],
};

pub const RESAMPLE: KernelFile = KernelFile {
    name: "resample.cu",
    source: include_str!("kernels/resample.cu"),
    kernels: &[
        "resize_plane_horizontal",
        "resize_plane_vertical",
        "f16_to_f32",
    ],
};

pub const GUIDED_FILTER: KernelFile = KernelFile {
    name: "guided_filter.cu",
    source: include_str!("kernels/guided_filter.cu"),
    kernels: &[
        "luma_rgb8",
        "box_rows_guide",
        "box_columns_coefficients",
        "box_rows_coefficients",
        "box_columns_means",
    ],
};

pub const COMPOSITE: KernelFile = KernelFile {
    name: "composite.cu",
    source: include_str!("kernels/composite.cu"),
    kernels: &[
        "quantize_alpha",
        "quantize_alpha_cutout",
        "guided_alpha",
        "guided_alpha_cutout",
    ],
};

pub const FILES: [KernelFile; 5] = [PREPROCESS, TRIMAP, RESAMPLE, GUIDED_FILTER, COMPOSITE];

/// NVRTC options for every file. `--fmad=false`: no contraction of `a * b + c` into an
/// FMA, which would round once where the CPU rounds twice; IEEE division and square root;
/// denormals kept. These are what make the kernels bit-exact with the CPU stages where
/// they compute what the CPU does, and their bounds hold where the CPU's f64 is replaced
/// (docs/gpu.md, "Arithmetic on the GPUs users rent").
pub const COMPILE_OPTIONS: [&str; 5] = [
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
    "--std=c++17",
];

/// The architectures celer's tests and `scripts/gpu-check` compile for: Turing, Ampere
/// (A100 and consumer), Ada, Hopper.
pub const TESTED_ARCHS: [Arch; 5] = [
    Arch::new(7, 5),
    Arch::new(8, 0),
    Arch::new(8, 6),
    Arch::new(8, 9),
    Arch::new(9, 0),
];

/// The compiled files for one architecture, in [`FILES`] order, and the NVRTC version
/// that made them (a driver of that CUDA version or newer loads them).
#[derive(Debug)]
pub struct Cubins {
    pub arch: Arch,
    pub nvrtc: CudaVersion,
    pub files: Vec<(&'static str, Vec<u8>)>,
}

/// Compiles every file for `arch` with NVRTC (no cache).
pub fn compile_all(nvrtc: &Nvrtc, arch: Arch) -> Result<Cubins, CudaError> {
    let files = FILES
        .iter()
        .map(|file| {
            let source = Source {
                name: file.name,
                text: file.source,
                headers: &[COMMON_HEADER],
            };
            nvrtc
                .compile_cubin(&source, arch, &COMPILE_OPTIONS)
                .map(|cubin| (file.name, cubin))
        })
        .collect::<Result<_, _>>()?;
    Ok(Cubins {
        arch,
        nvrtc: nvrtc.version(),
        files,
    })
}

/// The CUBINs for `arch` that a CUDA `driver` loads: from this process's cache, else the
/// shipped folder (`CELER_KERNEL_DIR`), else the disk cache, else NVRTC (the newest not
/// newer than the driver, which then fills the process's and the disk cache). Compiles at
/// most once per architecture and driver per process; with the architecture shipped,
/// NVRTC is never loaded.
pub fn cubins_for(arch: Arch, driver: CudaVersion) -> Result<Arc<Cubins>, CudaError> {
    type Loaded = HashMap<(Arch, CudaVersion), Arc<Cubins>>;
    static CACHE: Mutex<Option<Loaded>> = Mutex::new(None);
    // A poisoned lock only means another thread panicked mid-compile; the map is intact.
    let mut guard = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(found) = map.get(&(arch, driver)) {
        return Ok(found.clone());
    }
    let cubins = Arc::new(
        match read_shipped(arch, driver).or_else(|| read_disk_cache(arch, driver)) {
            Some(cubins) => cubins,
            None => {
                let cubins = compile_all(Nvrtc::for_driver(driver)?, arch)?;
                write_disk_cache(&cubins);
                cubins
            }
        },
    );
    map.insert((arch, driver), cubins.clone());
    Ok(cubins)
}

/// `CELER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/celer/kernels`, else
/// `$HOME/.cache/celer/kernels`.
pub fn disk_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("CELER_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("celer").join("kernels"))
}

/// A cached file's name: a hash of everything that shapes the output (every source, the
/// header, the options), so edited kernels never load stale, the architecture, and the
/// NVRTC version (a driver older than it cannot load the file), e.g.
/// `0123456789abcdef-sm_90-nvrtc12.2-trimap.cubin`.
pub fn cache_file_name(arch: Arch, nvrtc: CudaVersion, file: &str) -> String {
    format!(
        "{}nvrtc{nvrtc}-{}.cubin",
        cache_prefix(arch),
        file.trim_end_matches(".cu")
    )
}

/// What every cached file of `arch` made by this celer's sources begins with.
fn cache_prefix(arch: Arch) -> String {
    let mut hash = Fnv64::new();
    hash.write(COMMON_HEADER.1.as_bytes());
    for f in &FILES {
        hash.write(f.name.as_bytes());
        hash.write(f.source.as_bytes());
    }
    for option in COMPILE_OPTIONS {
        hash.write(option.as_bytes());
    }
    format!("{:016x}-{}-", hash.finish(), arch.sm())
}

/// `CELER_KERNEL_DIR`: a read-only folder of CUBINs made ahead of time by `celer kernels`
/// with this same binary (the file names carry a hash of the sources and options).
pub fn shipped_dir() -> Option<PathBuf> {
    std::env::var_os("CELER_KERNEL_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
}

fn read_shipped(arch: Arch, driver: CudaVersion) -> Option<Cubins> {
    let dir = shipped_dir()?;
    match read_compatible_from(&dir, arch, driver) {
        Some(cubins) => {
            tracing::info!(
                gpu = %arch,
                kernels = %cubins.arch,
                nvrtc = %cubins.nvrtc,
                dir = %dir.display(),
                "kernels loaded from CELER_KERNEL_DIR"
            );
            Some(cubins)
        }
        None => {
            // Not an error: the writable cache or NVRTC may still have them. Logged so that
            // a compile at start-up (or NVRTC missing) is explained.
            tracing::warn!(
                %arch,
                %driver,
                dir = %dir.display(),
                "CELER_KERNEL_DIR has no kernels built by this celer for this GPU's \
                 architecture by an NVRTC this driver loads; trying the kernel cache, then NVRTC"
            );
            None
        }
    }
}

/// The CUBINs in `dir` that run on a GPU of architecture `arch` under a CUDA `driver`:
/// its own, else those of the nearest lower minor revision of the same major (a CUBIN
/// runs on every GPU of its major revision and an equal or higher minor one), so that a
/// folder made by an older NVRTC still serves, say, an sm_103 GPU with sm_100 code.
pub fn read_compatible_from(
    dir: &std::path::Path,
    arch: Arch,
    driver: CudaVersion,
) -> Option<Cubins> {
    (0..=arch.minor)
        .rev()
        .find_map(|minor| read_cache_from(dir, Arch::new(arch.major, minor), driver))
}

fn read_disk_cache(arch: Arch, driver: CudaVersion) -> Option<Cubins> {
    let dir = disk_cache_dir()?;
    let cubins = read_cache_from(&dir, arch, driver)?;
    tracing::debug!(%arch, nvrtc = %cubins.nvrtc, dir = %dir.display(), "kernels loaded from the disk cache");
    Some(cubins)
}

/// The CUBINs for `arch` from the cache folder `dir` that a CUDA `driver` loads: of the
/// NVRTC versions not newer than the driver with every file there, the newest.
pub fn read_cache_from(dir: &std::path::Path, arch: Arch, driver: CudaVersion) -> Option<Cubins> {
    let prefix = format!("{}nvrtc", cache_prefix(arch));
    let mut versions: Vec<CudaVersion> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let (major, minor) = name
                .strip_prefix(&prefix)?
                .split_once('-')?
                .0
                .split_once('.')?;
            Some(CudaVersion::new(major.parse().ok()?, minor.parse().ok()?))
        })
        .filter(|nvrtc| *nvrtc <= driver)
        .collect();
    versions.sort_unstable_by_key(|v| std::cmp::Reverse(*v));
    versions.dedup();
    versions.into_iter().find_map(|nvrtc| {
        let files = FILES
            .iter()
            .map(|f| {
                std::fs::read(dir.join(cache_file_name(arch, nvrtc, f.name)))
                    .ok()
                    .map(|bytes| (f.name, bytes))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Cubins { arch, nvrtc, files })
    })
}

/// Best effort: a cache that cannot be written only costs a compile next time.
pub fn write_disk_cache(cubins: &Cubins) {
    let Some(dir) = disk_cache_dir() else { return };
    if let Err(e) = write_cache_to(&dir, cubins) {
        tracing::debug!(dir = %dir.display(), error = %e, "kernel cache not writable");
    }
}

/// Writes `cubins` into the cache folder `dir` (for example a folder shipped with a
/// build, so that a machine without NVRTC loads the kernels from it).
pub fn write_cache_to(dir: &std::path::Path, cubins: &Cubins) -> std::io::Result<()> {
    for (name, bytes) in &cubins.files {
        // Atomically, so that a concurrent reader never sees half a file.
        crate::host::atomic_write::write_atomically(
            &dir.join(cache_file_name(cubins.arch, cubins.nvrtc, name)),
            bytes,
        )?;
    }
    Ok(())
}

/// FNV-1a, 64 bit: stable across Rust versions, unlike `DefaultHasher`.
struct Fnv64(u64);

impl Fnv64 {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator, so that ("ab", "c") and ("a", "bc") differ.
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}
