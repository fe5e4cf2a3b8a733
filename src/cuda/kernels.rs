//! The CUDA C kernels (`kernels/*.cu`, embedded in the binary) and their compilation: one
//! CUBIN per file per GPU architecture, compiled once per process and architecture and
//! shared by every device and replica of that architecture, and kept in a disk cache so
//! that a restart (or a machine without NVRTC) loads them without compiling. A read-only
//! folder shipped with the build (`CELER_KERNEL_DIR`, filled by `celer kernels`; the GPU
//! image's `/opt/celer/kernels`) is read first.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::nvrtc::{Arch, Nvrtc, Source};
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
/// denormals kept. These are what make the kernels bit-exact with the CPU stages.
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

/// The compiled files for one architecture, in [`FILES`] order.
#[derive(Debug)]
pub struct Cubins {
    pub arch: Arch,
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
    Ok(Cubins { arch, files })
}

/// The CUBINs for `arch`: from this process's cache, else the shipped folder
/// (`CELER_KERNEL_DIR`), else the disk cache, else NVRTC (which then fills the process's
/// and the disk cache). Compiles at most once per architecture per process; with the
/// architecture shipped, NVRTC is never loaded.
pub fn cubins_for(arch: Arch) -> Result<Arc<Cubins>, CudaError> {
    static CACHE: Mutex<Option<HashMap<Arch, Arc<Cubins>>>> = Mutex::new(None);
    // A poisoned lock only means another thread panicked mid-compile; the map is intact.
    let mut guard = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(found) = map.get(&arch) {
        return Ok(found.clone());
    }
    let cubins = Arc::new(match read_shipped(arch).or_else(|| read_disk_cache(arch)) {
        Some(cubins) => cubins,
        None => {
            let cubins = compile_all(Nvrtc::get()?, arch)?;
            write_disk_cache(&cubins);
            cubins
        }
    });
    map.insert(arch, cubins.clone());
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

/// A cached file's name: the architecture and a hash of everything that shapes the
/// output (every source, the header, the options), so edited kernels never load stale.
pub fn cache_file_name(arch: Arch, file: &str) -> String {
    let mut hash = Fnv64::new();
    hash.write(COMMON_HEADER.1.as_bytes());
    for f in &FILES {
        hash.write(f.name.as_bytes());
        hash.write(f.source.as_bytes());
    }
    for option in COMPILE_OPTIONS {
        hash.write(option.as_bytes());
    }
    format!(
        "{:016x}-{}-{}.cubin",
        hash.finish(),
        arch.sm(),
        file.trim_end_matches(".cu")
    )
}

/// `CELER_KERNEL_DIR`: a read-only folder of CUBINs made ahead of time by `celer kernels`
/// with this same binary (the file names carry a hash of the sources and options).
pub fn shipped_dir() -> Option<PathBuf> {
    std::env::var_os("CELER_KERNEL_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
}

fn read_shipped(arch: Arch) -> Option<Cubins> {
    let dir = shipped_dir()?;
    match read_compatible_from(&dir, arch) {
        Some(cubins) => {
            tracing::info!(
                gpu = %arch,
                kernels = %cubins.arch,
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
                dir = %dir.display(),
                "CELER_KERNEL_DIR has no kernels for this GPU's architecture built by this \
                 celer; trying the kernel cache, then NVRTC"
            );
            None
        }
    }
}

/// The CUBINs in `dir` that run on a GPU of architecture `arch`: its own, else those of
/// the nearest lower minor revision of the same major (a CUBIN runs on every GPU of its
/// major revision and an equal or higher minor one), so that a folder made by an older
/// NVRTC still serves, say, an sm_103 GPU with sm_100 code.
pub fn read_compatible_from(dir: &std::path::Path, arch: Arch) -> Option<Cubins> {
    (0..=arch.minor)
        .rev()
        .find_map(|minor| read_cache_from(dir, Arch::new(arch.major, minor)))
}

fn read_disk_cache(arch: Arch) -> Option<Cubins> {
    let dir = disk_cache_dir()?;
    let cubins = read_cache_from(&dir, arch)?;
    tracing::debug!(%arch, dir = %dir.display(), "kernels loaded from the disk cache");
    Some(cubins)
}

/// The CUBINs for `arch` from the cache folder `dir`, if every file is there.
pub fn read_cache_from(dir: &std::path::Path, arch: Arch) -> Option<Cubins> {
    let files = FILES
        .iter()
        .map(|f| {
            std::fs::read(dir.join(cache_file_name(arch, f.name)))
                .ok()
                .map(|bytes| (f.name, bytes))
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Cubins { arch, files })
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
        crate::atomic_write::write_atomically(
            &dir.join(cache_file_name(cubins.arch, name)),
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
