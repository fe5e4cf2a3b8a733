//! Scheduling: devices, each with R replicas on their own OS threads fed by one bounded
//! queue; the router that places each request on the device expected to finish it first;
//! the per-device batcher; health (health checks, recovery of a lost device), fail-over and
//! admission. Model calls never run on the async executor.
//!
//! Everything is generic over `Executor` (what one replica runs: `crate::replica` for the
//! real pipeline, `sim` for simulated devices, which go through the same queues, threads
//! and router as real ones). Nothing here knows HTTP, images, CUDA or TensorRT. See
//! docs/architecture.md.

mod batcher;
mod choice;
pub mod cost;
pub mod device;
mod executor;
mod job;
pub mod metrics;
mod queue;
mod scheduler;
pub mod sim;
mod state;
mod terms;
#[cfg(test)]
mod test_support;
mod worker;

use std::time::{Duration, Instant};

pub use cost::{Prices, RunParts, Work};
pub use device::{Device, DeviceSelection};
pub use executor::{ExecError, Executor, LoadFn, Recovery, WarmRun};
pub use metrics::SchedMetrics;
pub use scheduler::{
    estimated_completion, Admission, Answer, DeviceSetup, DeviceView, QueueBudget,
    QueueBudgetError, Routing, Scheduler, SchedulerConfig, Scheduling, Ticket, REPROBE_AFTER,
};
pub use terms::{Priority, PriorityError, Terms};

/// A finished request: the executor's output and where and how it ran.
#[derive(Debug)]
pub struct Done<O> {
    pub output: O,
    /// Index of the device that ran it.
    pub device: usize,
    /// Time between entering the device's queue and starting to run.
    pub queued: Duration,
    /// When the run (its batch) started.
    pub started: Instant,
    /// Wall time of the model run (the whole batch's, when batched).
    pub compute: Duration,
    pub batch_size: usize,
    /// Whether it ran on a second device after the first failed.
    pub failed_over: bool,
}

/// Why a request was not admitted. Answered at once, before any work is queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("all {capacity} queue slots are taken")]
    Overloaded {
        capacity: usize,
        /// When a slot is expected to be free, from the devices' throughput.
        retry_after_ms: u64,
    },
    #[error("a new request would wait about {estimated_ms} ms for a replica, over the {budget_ms} ms allowed")]
    WaitTooLong {
        estimated_ms: u64,
        budget_ms: u64,
        /// When the expected wait is back within the budget.
        retry_after_ms: u64,
    },
    /// No device it was offered to would finish it by its deadline (the figures are
    /// those of the device expected to finish it first).
    #[error("the request would finish in about {expected_ms} ms, after its deadline in {deadline_ms} ms")]
    DeadlineUnreachable {
        expected_ms: u64,
        deadline_ms: u64,
        /// When the expected completion is back within the same deadline.
        retry_after_ms: u64,
    },
    /// The device expected to finish it first could, but only by making a request it
    /// admitted before miss its deadline (admitted requests keep their place), and no
    /// other device it was offered to would finish it in time.
    #[error("taking it now would make a request admitted before it miss its deadline")]
    AdmittedFirst {
        /// When the requests it would make late are expected to have started.
        retry_after_ms: u64,
    },
    #[error("no device is healthy")]
    NoHealthyDevice,
    #[error("the workers have stopped")]
    Stopped,
}

/// Why an admitted request did not produce a result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    #[error("the request's deadline passed before it finished")]
    DeadlineExceeded,
    /// Refused when a replica would have taken it: the run, as priced, would end after
    /// the deadline (it waited behind more urgent work).
    #[error("the request could no longer finish by its deadline")]
    DeadlineUnreachable,
    #[error("device {device}: {reason}")]
    Failed { device: String, reason: String },
    #[error("device {device}: the replica failed unexpectedly: {what}")]
    Panicked { device: String, what: String },
    #[error("device {device} was marked unhealthy while it held the request")]
    DeviceUnhealthy { device: String },
    #[error("device {device}: the replica dropped the request")]
    Dropped { device: String },
    /// The first device failed and no other could take the request.
    #[error("fail-over refused: {0}")]
    Rejected(SubmitError),
}

impl SubmitError {
    /// When a refused request may be worth retrying, if the refusal says.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Overloaded { retry_after_ms, .. }
            | Self::WaitTooLong { retry_after_ms, .. }
            | Self::DeadlineUnreachable { retry_after_ms, .. }
            | Self::AdmittedFirst { retry_after_ms } => {
                Some(Duration::from_millis(*retry_after_ms))
            }
            Self::NoHealthyDevice => Some(Duration::from_secs(1)),
            Self::Stopped => None,
        }
    }
}

impl JobError {
    /// A fault of the device rather than of the request's timing: worth one more try on
    /// another device. Not a panic: the same request would most likely panic there too,
    /// so it is answered as the server's error at once.
    fn is_device_fault(&self) -> bool {
        matches!(
            self,
            Self::Failed { .. } | Self::DeviceUnhealthy { .. } | Self::Dropped { .. }
        )
    }

    /// A short stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::DeadlineExceeded => "deadline",
            Self::DeadlineUnreachable => "deadline_unreachable",
            Self::Failed { .. } => "backend",
            Self::Panicked { .. } => "panic",
            Self::DeviceUnhealthy { .. } => "unhealthy",
            Self::Dropped { .. } => "dropped",
            Self::Rejected(_) => "failover_rejected",
        }
    }
}

/// The state of the replicas' model loading, over every device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Loading {
        loaded: usize,
        of: usize,
    },
    /// An interim device (the CPU) serves while the devices that stay load (the GPUs'
    /// engines build); `loaded` and `of` count theirs.
    Interim {
        loaded: usize,
        of: usize,
    },
    Ready,
    Failed(String),
}

/// A replica failed to load: the first failure, as `Readiness::Failed` says it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LoadFailed(pub String);
