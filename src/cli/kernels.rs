//! `celer kernels`: the CUDA kernels compiled ahead of time into a folder, so that a
//! machine or image without NVRTC (or that should not compile at start-up) loads them
//! with `CELER_KERNEL_DIR=DIR`. The GPU image runs it at build time into
//! `/opt/celer/kernels`. Needs NVRTC, not a GPU; compiles with every NVRTC it finds
//! (`CELER_NVRTC_PATH` names one), each file named after its NVRTC's version.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use crate::cuda::kernels::{compile_all, write_cache_to, FILES};
use crate::cuda::nvrtc::Nvrtc;
use crate::cuda::Arch;

#[derive(Debug, Clone, Args)]
pub struct KernelsArgs {
    /// Folder the CUBINs are written to (created if missing); serve and run read it
    /// when `CELER_KERNEL_DIR` names it.
    #[arg(long)]
    pub out: PathBuf,

    /// GPU architectures, e.g. `sm_80,sm_90`. Default: every architecture each NVRTC
    /// found can compile for.
    #[arg(long, value_delimiter = ',')]
    pub arch: Vec<Arch>,
}

pub fn kernels(args: KernelsArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    // Every NVRTC found: a driver loads the files of the newest NVRTC not newer than it,
    // so a folder made by NVRTC 12.2 and 13 serves every driver from celer's floor up.
    for nvrtc in Nvrtc::all()? {
        compile_into(nvrtc, &args)?;
    }
    println!("load them with CELER_KERNEL_DIR={}", args.out.display());
    Ok(())
}

fn compile_into(nvrtc: &Nvrtc, args: &KernelsArgs) -> anyhow::Result<()> {
    let version = nvrtc.version();
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
            "NVRTC {version} ({}) cannot compile for {}; it supports {}",
            nvrtc.path(),
            unsupported.join(", "),
            supported
                .iter()
                .map(Arch::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!(
        "compiling {} kernel files with NVRTC {version} ({})",
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
        "NVRTC {version}: {} architectures in {}",
        archs.len(),
        args.out.display()
    );
    Ok(())
}
