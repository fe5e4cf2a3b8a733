//! CPU time of a process (all its threads, user and system), from Linux's `/proc`: what a
//! benchmark divides by the requests or runs it completed, to say what each one cost the
//! cores. On a machine whose cores are saturated, throughput is the cores' seconds over
//! the CPU seconds per request, so these figures say where a throughput ratio comes from
//! (the model, or the work around it) where wall times cannot.
//!
//! Elsewhere than Linux there is no `/proc`, and the figures are absent (`None`).

use std::time::Duration;

/// `/proc/<pid>/stat` counts in clock ticks of `USER_HZ`, which the kernel's ABI fixes at
/// 100 per second on every architecture it exports them for (whatever `HZ` it runs at).
const TICKS_PER_S: u64 = 100;

/// The CPU time the process `pid` has used so far, or `None` when it cannot be read
/// (no such process, or no `/proc`).
pub fn of_process(pid: u32) -> Option<Duration> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The CPU time this process has used so far.
pub fn of_self() -> Option<Duration> {
    parse_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)
}

/// The CPU time the calling thread has used so far, to the nanosecond
/// (`CLOCK_THREAD_CPUTIME_ID`; `/proc/thread-self/schedstat` lags by a scheduler tick for a
/// running thread, 4 ms, coarser than one request's host work).
pub fn of_this_thread() -> Option<Duration> {
    cpu_time::ThreadTime::try_now()
        .ok()
        .map(|t| t.as_duration())
}

/// `utime + stime` of a `/proc/<pid>/stat` line. The second field (the command, in
/// parentheses) may hold spaces and parentheses itself, so fields are counted from the
/// last `)`: the state is field 3, `utime` field 14 and `stime` field 15.
fn parse_stat(stat: &str) -> Option<Duration> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let ticks = utime.checked_add(stime)?;
    Some(Duration::from_millis(
        ticks.checked_mul(1000 / TICKS_PER_S)?,
    ))
}

/// CPU time between two readings, in milliseconds per item done in between; `None` when a
/// reading is missing or nothing was done.
pub fn ms_per(before: Option<Duration>, after: Option<Duration>, items: u64) -> Option<f64> {
    let used = after?.checked_sub(before?)?;
    (items > 0).then(|| used.as_secs_f64() * 1e3 / items as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_utime_and_stime_after_a_command_with_spaces_and_parentheses() {
        // Fields 1..=17 of a real line; the command is "tokio (rt) 1".
        let line = "4242 (tokio (rt) 1) S 1 4242 4242 0 -1 4194560 1234 0 0 0 \
                    250 37 0 0 20 0 9 0 12345 0 0";
        assert_eq!(parse_stat(line), Some(Duration::from_millis(2870)));
    }

    #[test]
    fn this_thread_uses_cpu_time_as_it_works() {
        let before = of_this_thread().expect("the thread's CPU clock");
        let mut x = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let after = of_this_thread().expect("the thread's CPU clock");
        assert!(after > before, "{before:?} -> {after:?}");
    }

    #[test]
    fn a_truncated_or_garbled_line_is_none() {
        assert_eq!(parse_stat("4242 (x) S 1 2 3"), None);
        assert_eq!(parse_stat("no parenthesis at all"), None);
        assert_eq!(parse_stat("1 (x) S 1 1 1 0 -1 0 0 0 0 0 ten 5 0 0"), None);
    }

    #[test]
    fn this_process_uses_cpu_time_as_it_works() {
        let before = of_self().expect("Linux has /proc/self/stat");
        // Ticks are 10 ms: work until two have been counted (a bound on the wall time
        // only so that a reading that never grows fails instead of hanging).
        let started = std::time::Instant::now();
        let mut x = 0u64;
        while of_self().expect("still readable") < before + Duration::from_millis(20) {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "CPU time did not grow"
            );
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
        }
        let by_pid = of_process(std::process::id()).expect("this process's own stat");
        assert!(by_pid >= before + Duration::from_millis(20), "{by_pid:?}");
    }

    #[test]
    fn per_item_needs_both_readings_and_some_items() {
        let (a, b) = (
            Some(Duration::from_millis(100)),
            Some(Duration::from_millis(400)),
        );
        assert_eq!(ms_per(a, b, 3), Some(100.0));
        assert_eq!(ms_per(a, b, 0), None);
        assert_eq!(ms_per(None, b, 3), None);
        assert_eq!(ms_per(b, a, 3), None);
    }
}
