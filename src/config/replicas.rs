//! How a device's replicas and their ONNX Runtime threads are laid out over the cores
//! this process may use (`host::cpus`: the container's quota, not the host's count).
//! Counts are at least 1 by construction: the command line refuses 0.

use crate::host::cpus::CpuBudget;

/// Replicas per device and ONNX Runtime threads per replica, as asked (`None`: the
/// cores decide).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replicas {
    pub replicas: Option<usize>,
    pub threads_per_replica: Option<usize>,
    /// Threads of the solo set a lone CPU replica borrows (`replica::cores`).
    pub solo_threads: Option<usize>,
}

impl Replicas {
    /// `(replicas, threads per replica)` on the CPU, keeping their product within the
    /// cores.
    pub fn on_cpu(&self) -> (usize, usize) {
        self.on_cores(CpuBudget::get().cores)
    }

    /// As `on_cpu`, on `cores` cores.
    pub fn on_cores(&self, cores: usize) -> (usize, usize) {
        let cores = cores.max(1);
        match (self.replicas, self.threads_per_replica) {
            (Some(r), Some(t)) => (r, t),
            (Some(r), None) => (r, (cores / r).max(1)),
            (None, Some(t)) => ((cores / t).max(1), t),
            // Two replicas when there are cores for it: while one replica is in its
            // single-threaded stages (trimap, matting), the other keeps the model busy.
            (None, None) => {
                let r = if cores >= 2 { 2 } else { 1 };
                (r, cores / r)
            }
        }
    }

    /// Threads a replica running alone on the CPU gets, when each replica has `own`:
    /// `--solo-threads` (default the cores), never fewer than `own` (then no solo set is
    /// loaded).
    pub fn solo(&self, own: usize) -> usize {
        self.solo_threads.unwrap_or(CpuBudget::get().cores).max(own)
    }

    /// Replicas per GPU, and ONNX Runtime threads for each where TensorRT is absent (the
    /// `gpus` x replicas share the cores).
    pub fn on_gpus(&self, gpus: usize) -> (usize, usize) {
        let replicas = self.replicas.unwrap_or(2);
        let threads = self
            .threads_per_replica
            .unwrap_or((CpuBudget::get().cores / (replicas * gpus.max(1))).max(1));
        (replicas, threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replica and thread defaults of `celer serve` and `celer run` follow the quota
    /// read from the cgroup files, not the host's 64 cores.
    #[test]
    fn replicas_and_threads_follow_the_quota() {
        let root = tempfile::tempdir().unwrap();
        let on_quota = |cpu_max: &str| {
            for (path, text) in [
                ("proc/self/cgroup", "0::/\n"),
                ("sys/fs/cgroup/cpu.max", cpu_max),
            ] {
                let file = root.path().join(path);
                std::fs::create_dir_all(file.parent().unwrap()).unwrap();
                std::fs::write(file, text).unwrap();
            }
            Replicas::default().on_cores(CpuBudget::read(root.path(), 64).cores)
        };
        // An inference component given 4 cores: 2 replicas x 2 threads, not 2 x 32.
        assert_eq!(on_quota("400000 100000\n"), (2, 2));
        // Serverless with 1.5 vCPUs: one replica, one thread.
        assert_eq!(on_quota("150000 100000\n"), (1, 1));
        // No quota: the host's cores.
        assert_eq!(on_quota("max 100000\n"), (2, 32));
    }
}
