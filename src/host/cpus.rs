//! The cores this process may use: the least of the host's cores, its affinity mask and
//! the CPU quota of its cgroup. A container is given a quota, not a machine: `docker run
//! --cpus`, Kubernetes CPU limits, SageMaker inference components (each copy's
//! `NumberOfCpuCoresRequired`) and serverless endpoints (vCPUs in proportion to memory)
//! all set one, while the container still sees every core of the host. Sizing replicas x
//! threads by the host's count would oversubscribe the quota, and the kernel's throttling
//! then stalls every thread for the rest of each period.
//!
//! Read from `/proc/self/status` (`Cpus_allowed_list`), `/proc/self/cgroup`,
//! `/proc/self/mountinfo` and the cgroup files they lead to: `cpu.max` (cgroup v2) or
//! `cpu.cfs_quota_us` / `cpu.cfs_period_us` (v1), at the process's own cgroup and every
//! ancestor up to the mount (the tightest one counts). A quota of 1.5 cores gives 1: a
//! second thread would be throttled for a quarter of every period.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// What limits this process's cores, and the resulting count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuBudget {
    /// The cores to size replicas and threads by: never 0.
    pub cores: usize,
    /// CPUs in the affinity mask (or the host's count when the mask is unreadable).
    pub allowed: usize,
    /// The tightest cgroup quota, if any.
    pub quota: Option<Quota>,
}

/// A cgroup CPU quota: `quota_us` of CPU time every `period_us`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    pub quota_us: u64,
    pub period_us: u64,
    /// The file it was read from.
    pub file: PathBuf,
}

impl Quota {
    /// Whole cores the quota pays for, at least 1.
    pub fn cores(&self) -> usize {
        ((self.quota_us / self.period_us.max(1)) as usize).max(1)
    }
}

impl CpuBudget {
    /// The budget of this process, read once.
    pub fn get() -> &'static CpuBudget {
        static BUDGET: OnceLock<CpuBudget> = OnceLock::new();
        BUDGET.get_or_init(|| {
            let host = std::thread::available_parallelism().map_or(1, |n| n.get());
            Self::read(Path::new("/"), host)
        })
    }

    /// The budget as read under `root` (`/`, or a fixture tree with the same layout),
    /// with `host` cores when the affinity mask cannot be read.
    pub fn read(root: &Path, host: usize) -> CpuBudget {
        let allowed = std::fs::read_to_string(root.join("proc/self/status"))
            .ok()
            .and_then(|status| {
                status.lines().find_map(|line| {
                    line.strip_prefix("Cpus_allowed_list:")
                        .and_then(|list| count_cpu_list(list.trim()))
                })
            })
            .unwrap_or(host)
            .max(1);
        let quota = cgroup_quota(root);
        let cores = quota
            .as_ref()
            .map_or(allowed, |q| q.cores().min(allowed))
            .max(1);
        CpuBudget {
            cores,
            allowed,
            quota,
        }
    }

    /// One line for the log: `2 (cgroup quota 200000/100000 us in /sys/fs/...)`.
    pub fn describe(&self) -> String {
        match &self.quota {
            Some(q) if q.cores() < self.allowed => format!(
                "{} (cgroup CPU quota {}/{} us in {}; {} CPUs allowed)",
                self.cores,
                q.quota_us,
                q.period_us,
                q.file.display(),
                self.allowed
            ),
            _ => format!("{} (CPUs allowed; no tighter cgroup quota)", self.cores),
        }
    }
}

/// `0-3,8,10-11` -> 7.
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                n += b.checked_sub(a)? + 1;
            }
            None => {
                part.parse::<usize>().ok()?;
                n += 1;
            }
        }
    }
    (n > 0).then_some(n)
}

/// A cgroup hierarchy that controls CPU: where it is mounted, and the process's cgroup
/// in it.
struct Hierarchy {
    v2: bool,
    /// The mount point, under `root`.
    mount: PathBuf,
    /// The process's cgroup relative to the mount's root.
    relative: PathBuf,
}

fn cgroup_quota(root: &Path) -> Option<Quota> {
    let cgroups = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let mountinfo = std::fs::read_to_string(root.join("proc/self/mountinfo")).unwrap_or_default();
    let mut tightest: Option<Quota> = None;
    for h in hierarchies(root, &cgroups, &mountinfo) {
        // From the process's own cgroup up to the mount point; a nested cgroup cannot
        // use more than its parent allows.
        let mut dir = h.mount.join(&h.relative);
        loop {
            if let Some(q) = read_quota(&dir, h.v2) {
                if tightest
                    .as_ref()
                    .is_none_or(|t| q.quota_us * t.period_us < t.quota_us * q.period_us)
                {
                    tightest = Some(q);
                }
            }
            if dir == h.mount || !dir.pop() || !dir.starts_with(&h.mount) {
                break;
            }
        }
    }
    tightest
}

fn read_quota(dir: &Path, v2: bool) -> Option<Quota> {
    let positive = |s: &str| s.trim().parse::<u64>().ok().filter(|&v| v > 0);
    if v2 {
        let file = dir.join("cpu.max");
        let text = std::fs::read_to_string(&file).ok()?;
        let mut fields = text.split_whitespace();
        let quota_us = positive(fields.next()?)?; // "max": no quota
        let period_us = fields.next().and_then(positive).unwrap_or(100_000);
        Some(Quota {
            quota_us,
            period_us,
            file,
        })
    } else {
        let file = dir.join("cpu.cfs_quota_us");
        // -1: no quota.
        let quota_us = positive(&std::fs::read_to_string(&file).ok()?)?;
        let period_us = std::fs::read_to_string(dir.join("cpu.cfs_period_us"))
            .ok()
            .and_then(|p| positive(&p))
            .unwrap_or(100_000);
        Some(Quota {
            quota_us,
            period_us,
            file,
        })
    }
}

/// The CPU-controlling hierarchies of `/proc/self/cgroup` (`0::/path` for v2,
/// `N:cpu,cpuacct:/path` for v1), placed by `/proc/self/mountinfo`; without a matching
/// mount line, the usual places under `/sys/fs/cgroup`.
fn hierarchies(root: &Path, cgroups: &str, mountinfo: &str) -> Vec<Hierarchy> {
    // (v2, mount point, mount root)
    let mounts: Vec<(bool, &str, &str, &str)> = mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let dash = fields.iter().position(|f| *f == "-")?;
            let (mount_root, mount_point) = (*fields.get(3)?, *fields.get(4)?);
            let fstype = *fields.get(dash + 1)?;
            let options = fields.get(dash + 3).copied().unwrap_or_default();
            match fstype {
                "cgroup2" => Some((true, mount_point, mount_root, "")),
                "cgroup" => Some((false, mount_point, mount_root, options)),
                _ => None,
            }
        })
        .collect();
    let under_root = |p: &str| root.join(p.trim_start_matches('/'));
    let relative_to = |path: &str, mount_root: &str| -> PathBuf {
        let rel = Path::new(path)
            .strip_prefix(mount_root)
            .unwrap_or(Path::new(path));
        rel.strip_prefix("/").unwrap_or(rel).to_path_buf()
    };
    let mut out = Vec::new();
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            let (mount, relative) = match mounts.iter().find(|m| m.0) {
                Some((_, point, mount_root, _)) => {
                    (under_root(point), relative_to(path, mount_root))
                }
                None => (under_root("sys/fs/cgroup"), relative_to(path, "/")),
            };
            out.push(Hierarchy {
                v2: true,
                mount,
                relative,
            });
        } else if controllers.split(',').any(|c| c == "cpu") {
            let found = mounts
                .iter()
                .find(|m| !m.0 && m.3.split(',').any(|o| o == "cpu"));
            let (mount, relative) = match found {
                Some((_, point, mount_root, _)) => {
                    (under_root(point), relative_to(path, mount_root))
                }
                None => {
                    let named = under_root(&format!("sys/fs/cgroup/{controllers}"));
                    let mount = if named.is_dir() {
                        named
                    } else {
                        under_root("sys/fs/cgroup/cpu")
                    };
                    (mount, relative_to(path, "/"))
                }
            };
            out.push(Hierarchy {
                v2: false,
                mount,
                relative,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/` with the given files.
    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    const STATUS_8: &str = "Name:\tceler\nCpus_allowed:\tff\nCpus_allowed_list:\t0-7\n";

    #[test]
    fn cpu_lists_count() {
        assert_eq!(count_cpu_list("0-7"), Some(8));
        assert_eq!(count_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(count_cpu_list("5"), Some(1));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
    }

    #[test]
    fn cgroup_v2_quota_of_a_container_namespace() {
        // What a container with `--cpus 2.5` sees under cgroup v2 with its own namespace.
        let root = tree(&[
            ("proc/self/status", STATUS_8),
            ("proc/self/cgroup", "0::/\n"),
            (
                "proc/self/mountinfo",
                "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n",
            ),
            ("sys/fs/cgroup/cpu.max", "250000 100000\n"),
        ]);
        let b = CpuBudget::read(root.path(), 64);
        assert_eq!((b.cores, b.allowed), (2, 8));
        assert_eq!(b.quota.as_ref().unwrap().quota_us, 250_000);
        assert!(
            b.describe().contains("cgroup CPU quota 250000/100000"),
            "{}",
            b.describe()
        );
    }

    #[test]
    fn cgroup_v2_nested_takes_the_tightest_ancestor() {
        let root = tree(&[
            ("proc/self/status", STATUS_8),
            ("proc/self/cgroup", "0::/kubepods/pod1/c1\n"),
            (
                "proc/self/mountinfo",
                "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
            ),
            ("sys/fs/cgroup/kubepods/cpu.max", "max 100000\n"),
            ("sys/fs/cgroup/kubepods/pod1/cpu.max", "100000 100000\n"),
            ("sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "400000 100000\n"),
        ]);
        let b = CpuBudget::read(root.path(), 64);
        assert_eq!(b.cores, 1);
        assert!(b.quota.unwrap().file.ends_with("kubepods/pod1/cpu.max"));
    }

    #[test]
    fn cgroup_v1_docker_layout() {
        // Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup shows the
        // host's path, and the container's own cgroup is bind-mounted at the controller.
        let root = tree(&[
            ("proc/self/status", STATUS_8),
            (
                "proc/self/cgroup",
                "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
            ),
            (
                "proc/self/mountinfo",
                "40 33 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n\
                 41 33 0:36 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n",
            ),
            ("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "300000\n"),
            ("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n"),
        ]);
        assert_eq!(CpuBudget::read(root.path(), 64).cores, 3);
    }

    #[test]
    fn cgroup_v1_without_a_quota_and_a_narrow_affinity_mask() {
        let root = tree(&[
            ("proc/self/status", "Cpus_allowed_list:\t2-3\n"),
            ("proc/self/cgroup", "3:cpu:/\n"),
            (
                "proc/self/mountinfo",
                "40 33 0:35 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n",
            ),
            ("sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n"),
            ("sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n"),
        ]);
        let b = CpuBudget::read(root.path(), 64);
        assert_eq!((b.cores, b.quota), (2, None));
    }

    #[test]
    fn a_quota_under_one_core_is_one_and_nothing_readable_is_the_host() {
        let root = tree(&[
            ("proc/self/cgroup", "0::/\n"),
            ("sys/fs/cgroup/cpu.max", "50000 100000\n"),
        ]);
        // No mountinfo: the usual place; no status: the host's count.
        let b = CpuBudget::read(root.path(), 16);
        assert_eq!((b.cores, b.allowed), (1, 16));
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(CpuBudget::read(empty.path(), 6).cores, 6);
    }
}
