//! What a device's queue carries for a request: its input, what it asks of the device
//! (its work, priced on that device), its priority, its times and the channel its answer
//! goes back on. Made by the router, taken by the batcher and the replicas.

use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::cost::Work;
use super::state::Outstanding;
use super::{Done, Executor, JobError};

pub(crate) type Reply<O> = oneshot::Sender<Result<Done<O>, JobError>>;

pub(crate) struct Job<E: Executor> {
    pub input: E::Input,
    pub work: Work,
    /// `work`'s predicted service time on the device it is queued on.
    pub cost: Duration,
    /// Whether `cost` is measured; the prior's guess refuses nothing for its deadline.
    pub measured: bool,
    /// What its run may take at worst: `cost` times the device's recent overrun. The
    /// deadline is kept on it.
    pub worst: Duration,
    /// Sent although its price refused it, to measure the device's prices again: a run
    /// faster than priced, or than its worst, restarts them or their margin
    /// (`CostModel::restart_if_overpriced`).
    pub probe: bool,
    pub priority: u8,
    pub enqueued: Instant,
    pub deadline: Instant,
    /// The server's deadline: a run past it is taken for a stuck device.
    pub server_deadline: Instant,
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
