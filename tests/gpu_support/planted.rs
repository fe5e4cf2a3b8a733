//! The planted test kernels (tests/cuda_standin/kernels/planted.cu) as a CUBIN for a GPU:
//! compiled by NVRTC wherever one is found, as every checkout's tests do; else, on a GPU
//! machine without NVRTC, read from the folder `CELER_TEST_PLANTED_DIR`, which
//! `make gpu-check` fills ahead of time (`cuda_kernels --compile-planted`). Also included
//! by benches/cuda_kernels.rs, which writes that folder.
#![allow(dead_code)]

use std::io::Write;
use std::path::Path;

use celer::cuda::kernels::COMPILE_OPTIONS;
use celer::cuda::nvrtc::{Nvrtc, Source};
use celer::cuda::{Arch, CudaVersion};

/// The folder of planted CUBINs compiled ahead of time.
pub const DIR_ENV: &str = "CELER_TEST_PLANTED_DIR";

/// A CUBIN of the planted kernels, and where it came from.
pub struct PlantedCubin {
    pub cubin: Vec<u8>,
    pub from: String,
}

fn source() -> Source<'static> {
    Source {
        name: "planted.cu",
        text: celer_cuda_standin::PLANTED_KERNELS,
        headers: &[],
    }
}

/// The planted kernels for a GPU of `arch` under a CUDA `driver`: compiled by the NVRTC
/// for that driver, else (no NVRTC, or none old enough) read from `CELER_TEST_PLANTED_DIR`.
/// Says on stderr, past libtest's capture, which of the two it was.
pub fn cubin(arch: Arch, driver: CudaVersion) -> Result<PlantedCubin, String> {
    let planted = match Nvrtc::for_driver(driver) {
        Ok(nvrtc) => PlantedCubin {
            cubin: nvrtc
                .compile_cubin(&source(), arch, &COMPILE_OPTIONS)
                .map_err(|e| format!("the planted kernels do not compile: {e}"))?,
            from: format!(
                "{arch} compiled by NVRTC {} ({})",
                nvrtc.version(),
                nvrtc.path()
            ),
        },
        Err(no_nvrtc) => {
            precompiled(arch, driver).map_err(|why| format!("no NVRTC ({no_nvrtc}), and {why}"))?
        }
    };
    let _ = writeln!(std::io::stderr(), "planted kernels: {}", planted.from);
    Ok(planted)
}

/// From `CELER_TEST_PLANTED_DIR`: the CUBIN of `arch` (else of the nearest lower minor
/// revision of its major, which runs on it) by the newest NVRTC not newer than `driver`.
fn precompiled(arch: Arch, driver: CudaVersion) -> Result<PlantedCubin, String> {
    let dir = std::env::var_os(DIR_ENV)
        .filter(|d| !d.is_empty())
        .ok_or_else(|| {
            format!(
                "{DIR_ENV} names no folder of precompiled planted kernels (`make gpu-check` packs one)"
            )
        })?;
    let dir = Path::new(&dir);
    (0..=arch.minor)
        .rev()
        .map(|minor| Arch::new(arch.major, minor))
        .find_map(|compatible| {
            let nvrtc = newest_in(dir, compatible, driver)?;
            let path = dir.join(file_name(compatible, nvrtc));
            let cubin = std::fs::read(&path).ok()?;
            Some(PlantedCubin {
                cubin,
                from: format!(
                    "{compatible} by NVRTC {nvrtc}, precompiled: {} (NVRTC absent)",
                    path.display()
                ),
            })
        })
        .ok_or_else(|| {
            format!(
                "{} has no planted kernels of this source for {arch} (or a lower minor of \
                 sm_{}x) by an NVRTC no newer than the CUDA {driver} driver",
                dir.display(),
                arch.major
            )
        })
}

/// The newest NVRTC version of the files of `arch` in `dir` not newer than `driver`.
fn newest_in(dir: &Path, arch: Arch, driver: CudaVersion) -> Option<CudaVersion> {
    let prefix = format!("{}nvrtc", file_prefix(arch));
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let version = name.strip_prefix(&prefix)?.strip_suffix(".cubin")?;
            let (major, minor) = version.split_once('.')?;
            Some(CudaVersion::new(major.parse().ok()?, minor.parse().ok()?))
        })
        .filter(|nvrtc| *nvrtc <= driver)
        .max()
}

/// E.g. `planted-0123456789abcdef-sm_90-nvrtc12.2.cubin`: the hash of the source and the
/// options, so that a folder made from another planted.cu is never read.
pub fn file_name(arch: Arch, nvrtc: CudaVersion) -> String {
    format!("{}nvrtc{nvrtc}.cubin", file_prefix(arch))
}

fn file_prefix(arch: Arch) -> String {
    // FNV-1a, 64 bit: stable across Rust versions, unlike `DefaultHasher`.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in std::iter::once(celer_cuda_standin::PLANTED_KERNELS).chain(COMPILE_OPTIONS) {
        for &b in part.as_bytes().iter().chain(&[0xff]) {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("planted-{hash:016x}-{}-", arch.sm())
}

/// Compiles the planted kernels into `dir` with every NVRTC found, for each of `archs`
/// that NVRTC supports (every architecture it supports when `archs` is empty); one line
/// per NVRTC says what it wrote. Fails when an NVRTC supports none of `archs`.
pub fn compile_all_into(dir: &Path, archs: &[Arch]) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut lines = Vec::new();
    for nvrtc in Nvrtc::all().map_err(|e| e.to_string())? {
        let supported = nvrtc.supported_archs().map_err(|e| e.to_string())?;
        let targets: Vec<Arch> = if archs.is_empty() {
            supported
        } else {
            archs
                .iter()
                .copied()
                .filter(|a| supported.contains(a))
                .collect()
        };
        if targets.is_empty() {
            return Err(format!(
                "NVRTC {} ({}) supports none of {archs:?}",
                nvrtc.version(),
                nvrtc.path()
            ));
        }
        for &arch in &targets {
            let cubin = nvrtc
                .compile_cubin(&source(), arch, &COMPILE_OPTIONS)
                .map_err(|e| format!("the planted kernels for {arch}: {e}"))?;
            let path = dir.join(file_name(arch, nvrtc.version()));
            std::fs::write(&path, cubin).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        lines.push(format!(
            "planted kernels: NVRTC {} compiled {}",
            nvrtc.version(),
            targets
                .iter()
                .map(Arch::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    Ok(lines)
}
