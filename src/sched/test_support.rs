//! What the scheduler's unit tests share: an executor that answers with its inputs, a
//! device's state to count jobs on, and jobs to queue there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cost::Work;
use super::job::Job;
use super::metrics::SchedMetrics;
use super::state::{DeviceState, Outstanding};
use super::{ExecError, Executor};

pub(crate) struct Echo;

impl Executor for Echo {
    type Input = u32;
    type Output = u32;
    fn run_batch(&mut self, inputs: &[&u32]) -> Result<Vec<u32>, ExecError> {
        Ok(inputs.iter().map(|&&i| i).collect())
    }
    fn health_check(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
}

/// One device of one replica.
pub(crate) fn device_state() -> Arc<DeviceState> {
    Arc::new(DeviceState::new(
        0,
        "test".into(),
        1,
        false,
        SchedMetrics::default().for_device("test"),
        Instant::now(),
    ))
}

/// A job of `input` queued now on `state`'s device, priced (and at worst) `cost`, due in a
/// minute. Its answer's receiver is dropped: nothing here reads it.
pub(crate) fn job(state: &Arc<DeviceState>, input: u32, cost: Duration) -> Job<Echo> {
    let (reply, _) = tokio::sync::oneshot::channel();
    let now = Instant::now();
    Job {
        input,
        work: Work::default(),
        cost,
        measured: true,
        worst: cost,
        probe: false,
        priority: 5,
        enqueued: now,
        deadline: now + Duration::from_secs(60),
        server_deadline: now + Duration::from_secs(60),
        reply,
        _outstanding: Outstanding::new(state),
    }
}
