//! The HTTP runtime's share of the cores when the replicas need them. A flood of requests
//! that are refused (a 503 costs about a tenth of a millisecond, a request about a second
//! of a core on a CPU replica) is served as fast as the runtime can answer it, and closed-
//! loop clients that resend at once make that as fast as the cores allow: without a
//! priority the refusals take the cores from the admitted work they protect. So the
//! runtime's worker threads run at a lower priority (a higher nice value) than the
//! replicas' threads and the request path's CPU work (`work_pool`): idle cores still
//! serve refusals at full speed, contended ones go to the admitted work first.

use std::cell::Cell;
use std::io;

/// How much lower than the process's own the runtime's threads run. Linux's scheduler
/// weighs a thread at nice +10 at about a tenth of one at nice 0 (each step is 1.25x), so
/// against two busy replica threads the runtime keeps about 5 % of the cores: at a tenth
/// of a millisecond a refusal, a hundred or so refusals a second per percent of a core,
/// enough to answer every refused client of a flood within a second, and the admitted
/// requests' own I/O on the runtime is small next to their runs. A larger step would
/// slow the answers to the admitted requests' sockets; a smaller one gives refusals more.
pub const RUNTIME_NICE_STEP: i32 = 10;

/// The least priority Linux has.
const LOWEST: i32 = 19;

thread_local! {
    static LOWERED: Cell<bool> = const { Cell::new(false) };
}

/// Lowers this thread's priority by `step` (on Linux, a nice value is per thread), once
/// per thread: later calls on the same thread do nothing. Threads this one starts inherit
/// the lowered priority, and cannot raise it back without privileges: work that must
/// keep the process's priority runs on threads started elsewhere (`work_pool`).
pub fn lower_this_thread_once(step: i32) -> io::Result<()> {
    if LOWERED.with(|l| l.replace(true)) {
        return Ok(());
    }
    let me = Some(rustix::thread::gettid());
    let now = rustix::process::getpriority_process(me)?;
    rustix::process::setpriority_process(me, (now + step).min(LOWEST))?;
    Ok(())
}

/// This thread's nice value.
pub fn this_thread_nice() -> io::Result<i32> {
    Ok(rustix::process::getpriority_process(Some(
        rustix::thread::gettid(),
    ))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_is_lowered_once_and_its_children_inherit_it() {
        let base = this_thread_nice().unwrap();
        std::thread::spawn(move || {
            lower_this_thread_once(3).unwrap();
            lower_this_thread_once(3).unwrap();
            let lowered = this_thread_nice().unwrap();
            assert_eq!(lowered, (base + 3).min(LOWEST), "lowered once, not twice");
            let child = std::thread::spawn(|| this_thread_nice().unwrap())
                .join()
                .unwrap();
            assert_eq!(child, lowered, "a thread starts at its creator's priority");
        })
        .join()
        .unwrap();
        assert_eq!(
            this_thread_nice().unwrap(),
            base,
            "other threads keep theirs"
        );
    }
}
