//! `celer`: parse the command line, set up logging, dispatch.

use clap::Parser;

/// See Cargo.toml: memory returns to the system after load (the library and the tests
/// keep the system allocator).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// glibc's malloc, which ONNX Runtime (C++) allocates its activations from, set for a
/// model run's large blocks: they are mapped (mmap threshold 4 MiB) with transparent huge
/// pages (`glibc.malloc.hugetlb=1`), so each is faulted in 2 MiB at a time and unmapped
/// when freed: far fewer page faults and less CPU time a request than the default heap,
/// and a lower peak RSS, since freed blocks no longer sit in each thread's heap (figures
/// in docs/decisions.md, "glibc's malloc: huge pages, mapped from 4 MiB"). What smaller
/// blocks a burst left in the heaps goes back to the system when the server goes idle
/// (`cli::set_heap_trim`). glibc reads its tunables only at exec, and mimalloc its options
/// at start-up, hence `exec_tuned`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
mod glibc_heap {
    use std::ffi::c_int;
    use std::os::unix::process::CommandExt;

    const M_MMAP_THRESHOLD: c_int = -3;
    const TUNABLES: &str = "GLIBC_TUNABLES";
    const HUGE_PAGES: &str = "glibc.malloc.hugetlb";
    /// Set on the re-executed process, so that it never executes again, whatever glibc
    /// makes of `GLIBC_TUNABLES` (2.36 cuts the value at its colons in place).
    const TUNED: &str = "CELER_GLIBC_TUNED";

    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
        fn malloc_trim(pad: usize) -> c_int;
        /// mimalloc's: with `force`, purges what every thread freed at once, whatever the
        /// purge delay (and collects the calling thread's heap).
        fn mi_collect(force: bool);
    }

    /// Rust's allocations (mimalloc): what a request freed stays mapped this long, in
    /// milliseconds, for the next request to reuse, instead of mimalloc's default 1 s;
    /// the server gives it back sooner, when it goes idle (`trim`). Under mixed traffic a
    /// 12 MP photo's buffers were unmapped between one large request and the next, and
    /// each was faulted in and zeroed again: on this project's 2-core VMs a fault is slow
    /// (up to 85 % of both cores clearing pages while large requests came together), and
    /// runs slowed 2-4x past their price. Kept 10 s, large requests refused for longer
    /// than that (a deadline that binds) still found their stages' buffers gone (figures
    /// in docs/decisions.md, "Memory kept between requests").
    const PURGE_DELAY: &str = "MIMALLOC_PURGE_DELAY";
    const PURGE_DELAY_MS: &str = "600000";

    /// Runs this program again, same arguments and process, with `glibc.malloc.hugetlb=1`
    /// added to `GLIBC_TUNABLES` (unless that already names the tunable, so
    /// `glibc.malloc.hugetlb=0` opts out) and `MIMALLOC_PURGE_DELAY` set (unless it is
    /// already), unless both are set or this is the re-executed process. Returns only
    /// when it did not exec (nothing to do, or the exec failed: the program runs on
    /// without them).
    pub fn exec_tuned() {
        let current = std::env::var(TUNABLES).unwrap_or_default();
        let huge_pages = !current.contains(HUGE_PAGES);
        let purge_delay = std::env::var_os(PURGE_DELAY).is_none();
        if !(huge_pages || purge_delay) || std::env::var_os(TUNED).is_some() {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let mut command = std::process::Command::new(exe);
        if let Some(arg0) = args.next() {
            command.arg0(arg0);
        }
        command.args(args).env(TUNED, "1");
        if huge_pages {
            let value = match current.as_str() {
                "" => format!("{HUGE_PAGES}=1"),
                other => format!("{other}:{HUGE_PAGES}=1"),
            };
            command.env(TUNABLES, value);
        }
        if purge_delay {
            command.env(PURGE_DELAY, PURGE_DELAY_MS);
        }
        let err = command.exec();
        eprintln!("note: running without glibc's huge pages or mimalloc's purge delay: {err}");
    }

    pub fn tune() {
        // SAFETY: mallopt only sets a malloc parameter; called first thing in main, before
        // any other thread exists.
        unsafe { mallopt(M_MMAP_THRESHOLD, 4 << 20) };
        celer::cli::set_heap_trim(trim);
    }

    fn trim() {
        // SAFETY: malloc_trim takes malloc's own locks; it only returns free pages.
        unsafe { malloc_trim(0) };
        // SAFETY: mi_collect takes mimalloc's own locks and only gives back memory that
        // is free; any thread may call it.
        unsafe { mi_collect(true) };
    }
}

fn main() -> std::process::ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        glibc_heap::exec_tuned();
        glibc_heap::tune();
    }
    let cli = celer::cli::Cli::parse();
    if let Err(e) = celer::cli::logging::init() {
        eprintln!("error: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    match cli.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.is::<celer::cli::MustRestart>() {
                std::process::ExitCode::from(celer::cli::RESTART_EXIT_STATUS)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}
