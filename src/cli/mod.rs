//! The command line: `serve`, `run`, `build`, `inspect`, `kernels`, `bench`, `sim`. Each subcommand
//! lives in its own module and returns `anyhow::Result` (the binary's boundary; the
//! library uses typed errors).

pub mod args;
mod bench;
mod build;
mod devices;
mod inspect;
mod kernels;
pub mod logging;
pub mod resolve;
mod run;
mod serve;
mod sim;
mod variants;

pub use serve::{set_heap_trim, MustRestart, RESTART_EXIT_STATUS};

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "celer",
    version,
    about = "Low-latency inference for image model graphs"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// HTTP server speaking the SageMaker container contract (GET /ping, POST /invocations).
    Serve(args::ServeArgs),
    /// Offline inference on files or folders.
    Run(run::RunArgs),
    /// TensorRT engines for each GPU model of this machine (on a CPU-only machine:
    /// validates the models with ONNX Runtime).
    Build(build::BuildArgs),
    /// What is inside a model directory's pipeline, an ONNX model, or an engine.
    Inspect(inspect::InspectArgs),
    /// The CUDA kernels compiled ahead of time (needs NVRTC, not a GPU) into a folder that
    /// `CELER_KERNEL_DIR` names at run time, so that no NVRTC is needed there.
    Kernels(kernels::KernelsArgs),
    /// Latency benchmarking: load against a server, or in-process stage timings.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Capacity planning with simulated devices behind the real router: placement
    /// policies, scaling and overload, measured in wall time.
    Sim(sim::SimArgs),
}

impl Cli {
    pub fn run(self) -> anyhow::Result<()> {
        match self.command {
            Command::Serve(args) => serve::serve(args),
            Command::Run(args) => run::run(args),
            Command::Build(args) => build::build(args),
            Command::Inspect(args) => inspect::inspect(args),
            Command::Kernels(args) => kernels::kernels(args),
            Command::Bench(command) => bench::bench(command),
            Command::Sim(args) => sim::sim(args),
        }
    }
}

/// Loads and checks the pipeline description of `dir`, including that each model file
/// exists (with the command that fetches it when it does not).
pub fn load_pipeline(dir: &std::path::Path) -> anyhow::Result<crate::spec::PipelineSpec> {
    let spec = crate::spec::PipelineSpec::load_dir(dir)?;
    for (key, path) in spec.model_keys() {
        if !path.is_file() {
            return Err(crate::spec::SpecError::MissingModel {
                file: spec.source.clone(),
                key: key.into(),
                model: path.to_path_buf(),
                hint: "; `make models` (or `make models-all`) fetches the published models".into(),
            }
            .into());
        }
    }
    Ok(spec)
}
