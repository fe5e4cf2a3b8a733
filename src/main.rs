//! `celer`: parse the command line, set up logging, dispatch.

use std::io::IsTerminal;

use clap::Parser;

/// See Cargo.toml: memory returns to the system after load (the library and the tests
/// keep the system allocator).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// glibc's malloc, which ONNX Runtime (C++) allocates its activations from: a fixed
/// mmap threshold of 32 MiB, so that the large blocks of a run are reused from the heap
/// (not mapped and faulted in anew each run, about 30 % slower), and a trim when the
/// server goes idle (`cli::set_heap_trim`), so that what a busy minute took goes
/// back to the system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc_heap {
    use std::ffi::c_int;

    const M_MMAP_THRESHOLD: c_int = -3;

    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
        fn malloc_trim(pad: usize) -> c_int;
    }

    pub fn tune() {
        // SAFETY: mallopt only sets a malloc parameter; called first thing in main, before
        // any other thread exists.
        unsafe { mallopt(M_MMAP_THRESHOLD, 32 << 20) };
        celer::cli::set_heap_trim(trim);
    }

    fn trim() {
        // SAFETY: malloc_trim takes malloc's own locks; it only returns free pages.
        unsafe { malloc_trim(0) };
    }
}

fn main() -> std::process::ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    glibc_heap::tune();
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
