//! `celer kernels`: the CUDA kernels compiled ahead of time into a folder, so that a
//! machine or image without NVRTC (or that should not compile at start-up) loads them
//! with `CELER_KERNEL_DIR=DIR`. The GPU image runs it at build time into
//! `/opt/celer/kernels`. Needs NVRTC, not a GPU.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use crate::cuda::kernels::{compile_all, write_cache_to, FILES};
use crate::cuda::nvrtc::{Arch, Nvrtc};

#[derive(Debug, Clone, Args)]
pub struct KernelsArgs {
    /// Folder the CUBINs are written to (created if missing); serve and run read it
    /// when `CELER_KERNEL_DIR` names it.
    #[arg(long)]
    pub out: PathBuf,

    /// GPU architectures, e.g. `sm_80,sm_90`. Default: every architecture the loaded
    /// NVRTC can compile for.
    #[arg(long, value_delimiter = ',')]
    pub arch: Vec<Arch>,
}

pub fn kernels(args: KernelsArgs) -> anyhow::Result<()> {
    let nvrtc = Nvrtc::get()?;
    let (major, minor) = nvrtc.version()?;
    let supported = nvrtc.supported_archs()?;
    let archs = if args.arch.is_empty() {
        supported.clone()
    } else {
        args.arch.clone()
    };
    let unsupported: Vec<String> = archs
        .iter()
        .filter(|a| !supported.contains(a))
        .map(Arch::to_string)
        .collect();
    if !unsupported.is_empty() {
        anyhow::bail!(
            "NVRTC {major}.{minor} ({}) cannot compile for {}; it supports {}",
            nvrtc.path(),
            unsupported.join(", "),
            supported
                .iter()
                .map(Arch::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    println!(
        "compiling {} kernel files with NVRTC {major}.{minor} ({})",
        FILES.len(),
        nvrtc.path()
    );
    for arch in &archs {
        let started = Instant::now();
        let cubins = compile_all(nvrtc, *arch)?;
        write_cache_to(&args.out, &cubins)
            .with_context(|| format!("writing the kernels into {}", args.out.display()))?;
        let bytes: usize = cubins.files.iter().map(|(_, b)| b.len()).sum();
        println!(
            "  {arch}: {} files, {bytes} bytes in {:.1?}",
            cubins.files.len(),
            started.elapsed()
        );
    }
    println!(
        "{} architectures in {}: load them with CELER_KERNEL_DIR={}",
        archs.len(),
        args.out.display(),
        args.out.display()
    );
    Ok(())
}
