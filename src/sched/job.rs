//! What a device's queue carries: a request's job (its input, its times and the channel
//! its answer goes back on), a health check, or a stop. Made by the router, taken by the
//! batcher and the replicas.

use std::time::Instant;

use tokio::sync::oneshot;

use super::state::Outstanding;
use super::{Done, Executor, JobError};

/// What a device's queue carries.
pub(crate) enum Work<E: Executor> {
    Job(Job<E>),
    /// Run the executor's health check; a pass makes the device healthy.
    HealthCheck,
    /// One per replica at shutdown, behind the work already queued.
    Stop,
}

pub(crate) type Reply<O> = oneshot::Sender<Result<Done<O>, JobError>>;

pub(crate) struct Job<E: Executor> {
    pub input: E::Input,
    pub enqueued: Instant,
    pub deadline: Instant,
    pub reply: Reply<E::Output>,
    /// Held, not read: counts the job in its device's estimate while it exists.
    pub _outstanding: Outstanding,
}

impl<E: Executor> Job<E> {
    pub fn fail(self, error: JobError) {
        // The requester may have gone: nothing to tell then.
        let _ = self.reply.send(Err(error));
    }
}
