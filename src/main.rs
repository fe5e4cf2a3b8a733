//! `celer`: parse the command line, set up logging, dispatch.

use std::io::IsTerminal;

use clap::Parser;

/// See Cargo.toml: memory returns to the system after load (the library and the tests
/// keep the system allocator).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = celer::cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CELER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,ort=warn")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal: a container's log (CloudWatch, journald,
        // a file) would keep the escape codes as text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
