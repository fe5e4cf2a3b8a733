//! `celer`: parse the command line, set up logging, dispatch.

use std::io::IsTerminal;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = celer::cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CELER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,ort=warn")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: a container's log (CloudWatch for SageMaker) or a
        // file would get the escape codes as text.
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
