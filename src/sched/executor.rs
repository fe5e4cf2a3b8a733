//! What one replica runs, as the scheduler sees it: the `Executor` trait that the router,
//! the workers and the batcher are generic over. The real pipeline's executors are
//! `crate::replica`'s; the simulated devices' are `sim`'s. An executor belongs to one
//! replica thread and is never shared, so it needs no lock.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

use std::time::Duration;

use super::cost::{RunParts, Work};

/// Loads one replica's executor; called on that replica's own thread with its index.
pub type LoadFn<E> = Arc<dyn Fn(usize) -> Result<E, ExecError> + Send + Sync>;

/// An executor's failure, kept as the error it was (logged, never sent to a client), and
/// what it means for the device: the executor says so when it returns it, since only it
/// knows its device. Any error converts into `Failed` (`?`, `.into()`); an executor
/// whose device is lost returns `DeviceLost`.
pub enum ExecError {
    /// This run or health check failed; the device may take the next one.
    Failed(Box<dyn Error + Send + Sync>),
    /// The device is lost (a GPU whose context failed, for every replica on it): retrying
    /// is pointless until `Executor::recover` has brought it back.
    DeviceLost(Box<dyn Error + Send + Sync>),
}

impl ExecError {
    /// `error`, which lost the device.
    pub fn device_lost(error: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self::DeviceLost(error.into())
    }

    pub fn is_device_lost(&self) -> bool {
        matches!(self, Self::DeviceLost(_))
    }

    /// The error as the executor gave it.
    pub fn error(&self) -> &(dyn Error + Send + Sync + 'static) {
        match self {
            Self::Failed(e) | Self::DeviceLost(e) => e.as_ref(),
        }
    }
}

// Not `std::error::Error` itself (as `anyhow::Error` is not), so that every error, and
// every message, converts into it with `?`.
impl<E: Into<Box<dyn Error + Send + Sync>>> From<E> for ExecError {
    fn from(error: E) -> Self {
        Self::Failed(error.into())
    }
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.error(), f)
    }
}

impl fmt::Debug for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(e) => f.debug_tuple("Failed").field(e).finish(),
            Self::DeviceLost(e) => f.debug_tuple("DeviceLost").field(e).finish(),
        }
    }
}

/// What a replica's `recover` did: every replica of a lost device recovers, and only one
/// of them reopens it (the device's recoveries count that one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// This replica reopened the device and reloaded its replicas.
    Reopened,
    /// Another replica had already reopened it since this one found it lost.
    AlreadyReopened,
    /// The device cannot come back in this process (why: a library keeps state in its
    /// lost context, or a replica is stuck on it): it leaves service for good, and the
    /// server restarts the process (docs/gpu.md, "A lost GPU").
    NeedsRestart(String),
}

/// A run an executor made on its own at load (`Executor::warm_up`), timed: the device's
/// cost model learns from it as from a request's run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmRun {
    pub work: Work,
    pub took: Duration,
    pub parts: Option<RunParts>,
}

pub trait Executor: Send + 'static {
    /// One request's input. Cloned once when a request fails over to another device.
    type Input: Clone + Send + Sync + 'static;
    type Output: Send + 'static;

    /// Runs `inputs` as one batch (often of one) and returns one output per input, in
    /// order.
    fn run_batch(&mut self, inputs: &[&Self::Input]) -> Result<Vec<Self::Output>, ExecError>;

    /// A small inference whose success shows that an unhealthy device works again.
    fn health_check(&mut self) -> Result<(), ExecError>;

    /// Runs at load, before the replica takes requests: what a first run pays (memory
    /// faulted in, buffers sized) is paid before the first request, and the runs it
    /// times are the device's first prices. Default: none.
    fn warm_up(&mut self) -> Result<Vec<WarmRun>, ExecError> {
        Ok(Vec::new())
    }

    /// Told just before each `run_batch`: how many requests wait in this device's queue
    /// behind the batch. An executor that can give a lone run more of the device (the
    /// CPU's solo sessions, `crate::replica::cores`) tells a lone request from a busy
    /// device by it; the others ignore it.
    fn note_waiting(&mut self, _waiting: usize) {}

    /// What of `output`'s run was its fixed part (the models) and its composite, for the
    /// device's cost model (`super::cost`); for a batch, the fixed part is the batch's.
    /// `None`: not known, and the sizes of the requests alone separate the parts.
    fn parts(&self, _output: &Self::Output) -> Option<RunParts> {
        None
    }

    /// Brings a lost device back (reopen it, reload the models), on this replica's
    /// thread, after a run or health check returned `ExecError::DeviceLost`, while the
    /// router sends the device nothing. A passing health check then returns it
    /// to service; a failed recovery is tried again at the next failed health check.
    fn recover(&mut self) -> Result<Recovery, ExecError> {
        Ok(Recovery::Reopened)
    }

    /// Whether a run past its server deadline means the device is lost for good: a GPU
    /// whose kernel never ends (no watchdog on a datacenter GPU) cannot be interrupted, so
    /// the device leaves service and the server restarts (`Recovery::NeedsRestart`).
    /// Default: no (a slow run is routed around until it ends).
    fn stuck_is_lost(&self) -> bool {
        false
    }
}

impl<E: Executor + ?Sized> Executor for Box<E> {
    type Input = E::Input;
    type Output = E::Output;

    fn run_batch(&mut self, inputs: &[&Self::Input]) -> Result<Vec<Self::Output>, ExecError> {
        (**self).run_batch(inputs)
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        (**self).health_check()
    }

    fn warm_up(&mut self) -> Result<Vec<WarmRun>, ExecError> {
        (**self).warm_up()
    }

    fn note_waiting(&mut self, waiting: usize) {
        (**self).note_waiting(waiting)
    }

    fn parts(&self, output: &Self::Output) -> Option<RunParts> {
        (**self).parts(output)
    }

    fn recover(&mut self) -> Result<Recovery, ExecError> {
        (**self).recover()
    }

    fn stuck_is_lost(&self) -> bool {
        (**self).stuck_is_lost()
    }
}
