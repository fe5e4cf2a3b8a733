//! `celer`: parse the command line, set up logging, dispatch.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = celer::cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CELER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,ort=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
