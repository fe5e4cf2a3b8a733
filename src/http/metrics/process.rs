//! The process's own figures, read from Linux's `/proc` at scrape time: the standard
//! `process_*` families every Prometheus client exports (resident and virtual memory,
//! CPU seconds, open and maximum descriptors, start time), celer's peak resident memory
//! (one of its key figures), and Triton's host figures (`nv_cpu_utilization`,
//! `nv_cpu_memory_total_bytes`, `nv_cpu_memory_used_bytes`). A file that cannot be read
//! leaves its families out rather than failing the scrape.

use std::sync::Mutex;

use super::exposition::{Exposition, Kind};

/// The kernel's `USER_HZ`, the unit of `/proc`'s CPU times: fixed at 100 by the ABI on
/// every architecture celer builds for (x86-64, aarch64).
const TICKS_PER_SECOND: f64 = 100.0;

/// Machine-wide CPU time at the previous scrape, for `nv_cpu_utilization` over the
/// interval between scrapes (Triton's is over its own polling interval).
#[derive(Default)]
pub struct ProcessMetrics {
    last_cpu: Mutex<Option<CpuTimes>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct CpuTimes {
    busy: u64,
    total: u64,
}

impl ProcessMetrics {
    pub fn write(&self, e: &mut Exposition) {
        // Read once: the boot time and the machine's CPU times both come from it.
        let machine = std::fs::read_to_string("/proc/stat").ok();
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            if let Some(s) = SelfStat::parse(&stat) {
                e.single(
                    "process_cpu_seconds_total",
                    "Total user and system CPU time spent in seconds.",
                    Kind::Counter,
                    (s.utime + s.stime) as f64 / TICKS_PER_SECOND,
                );
                if let Some(boot) = machine.as_deref().and_then(boot_time) {
                    e.single(
                        "process_start_time_seconds",
                        "Start time of the process since unix epoch in seconds.",
                        Kind::Gauge,
                        boot as f64 + s.starttime as f64 / TICKS_PER_SECOND,
                    );
                }
            }
        }
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            let kib = |key: &str| field_kib(&status, key).map(|k| (k * 1024) as f64);
            if let Some(rss) = kib("VmRSS:") {
                e.single(
                    "process_resident_memory_bytes",
                    "Resident memory size in bytes.",
                    Kind::Gauge,
                    rss,
                );
            }
            if let Some(vm) = kib("VmSize:") {
                e.single(
                    "process_virtual_memory_bytes",
                    "Virtual memory size in bytes.",
                    Kind::Gauge,
                    vm,
                );
            }
            if let Some(peak) = kib("VmHWM:") {
                e.single(
                    "celer_process_resident_memory_peak_bytes",
                    "The most resident memory the process has held since it started, bytes.",
                    Kind::Gauge,
                    peak,
                );
            }
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            e.single(
                "process_open_fds",
                "Number of open file descriptors.",
                Kind::Gauge,
                fds.count() as f64,
            );
        }
        if let Some(max) = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| max_open_files(&l))
        {
            e.single(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                Kind::Gauge,
                max as f64,
            );
        }
        self.write_host(e, machine.as_deref());
    }

    /// Triton's host figures: the machine's memory and its CPUs' busy share (from
    /// `/proc/stat`'s text, `machine`).
    fn write_host(&self, e: &mut Exposition, machine: Option<&str>) {
        if let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") {
            if let (Some(total), Some(available)) = (
                field_kib(&meminfo, "MemTotal:"),
                field_kib(&meminfo, "MemAvailable:"),
            ) {
                e.single(
                    "nv_cpu_memory_total_bytes",
                    "CPU total memory (RAM), in bytes",
                    Kind::Gauge,
                    (total * 1024) as f64,
                );
                e.single(
                    "nv_cpu_memory_used_bytes",
                    "CPU used memory (RAM), in bytes",
                    Kind::Gauge,
                    (total.saturating_sub(available) * 1024) as f64,
                );
            }
        }
        let Some(now) = machine.and_then(CpuTimes::parse) else {
            return;
        };
        let mut last = self.last_cpu.lock().unwrap_or_else(|p| p.into_inner());
        // Since the previous scrape; since boot at the first.
        let since = last.replace(now).unwrap_or(CpuTimes { busy: 0, total: 0 });
        let total = now.total.saturating_sub(since.total);
        let busy = now.busy.saturating_sub(since.busy);
        let share = if total == 0 {
            0.0
        } else {
            busy as f64 / total as f64
        };
        e.single(
            "nv_cpu_utilization",
            "CPU utilization rate [0.0 - 1.0]",
            Kind::Gauge,
            share,
        );
    }
}

/// The fields of `/proc/self/stat` used here, in clock ticks.
struct SelfStat {
    utime: u64,
    stime: u64,
    starttime: u64,
}

impl SelfStat {
    fn parse(stat: &str) -> Option<Self> {
        // The command name (field 2) is in parentheses and may hold spaces: the fields
        // after its closing parenthesis start at field 3.
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3)?.parse().ok();
        Some(Self {
            utime: field(14)?,
            stime: field(15)?,
            starttime: field(22)?,
        })
    }
}

impl CpuTimes {
    /// The aggregate `cpu` line of `/proc/stat`: idle and iowait are not busy.
    fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let ticks: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let total: u64 = ticks.iter().take(8).sum();
        let idle = ticks.get(3)? + ticks.get(4).unwrap_or(&0);
        Some(Self {
            busy: total.saturating_sub(idle),
            total,
        })
    }
}

/// `key` in a `/proc` file of `Key:   1234 kB` lines.
fn field_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The `btime` line of `/proc/stat`: seconds since the epoch at boot.
fn boot_time(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// The soft limit on the `Max open files` line of `/proc/self/limits`.
fn max_open_files(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_are_read_as_the_kernel_writes_them() {
        let stat = "4242 (celer serve) S 1 4242 4242 0 -1 4194560 9 0 0 0 250 37 0 0 20 0 9 0 \
                    1234 1000 200 18446744073709551615";
        let s = SelfStat::parse(stat).unwrap();
        assert_eq!((s.utime, s.stime, s.starttime), (250, 37, 1234));
        assert_eq!(
            CpuTimes::parse("cpu  10 2 8 70 10 0 0 0 0 0\ncpu0 1 1 1 1 1 0 0 0 0 0\n"),
            Some(CpuTimes {
                busy: 20,
                total: 100
            })
        );
        let status = "Name:\tceler\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(field_kib(status, "VmRSS:"), Some(102_400));
        assert_eq!(field_kib(status, "VmHWM:"), Some(204_800));
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1048576              1048576              files\n";
        assert_eq!(max_open_files(limits), Some(1_048_576));
    }

    #[test]
    fn this_process_reports_its_memory_and_cpu() {
        let mut e = Exposition::default();
        ProcessMetrics::default().write(&mut e);
        let text = e.finish();
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        };
        assert!(value("process_resident_memory_bytes") > 0.0);
        assert!(
            value("celer_process_resident_memory_peak_bytes")
                >= value("process_resident_memory_bytes")
        );
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_start_time_seconds") > 1.6e9);
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!((0.0..=1.0).contains(&value("nv_cpu_utilization")));
        assert!(value("nv_cpu_memory_total_bytes") >= value("nv_cpu_memory_used_bytes"));
    }
}
