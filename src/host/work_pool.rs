//! The threads that run the request path's CPU work (parsing and decoding bodies,
//! encoding answers), started once by whoever builds the server, at that thread's
//! priority. Not tokio's blocking pool: it starts its threads from whichever runtime
//! thread first needs one, and a thread inherits its creator's priority, so with the
//! runtime's threads lowered (`priority`) an admitted request's decode would run at the
//! refusals' priority. Sized by the caller to the work that can be in progress at once
//! (the admitted requests), so that no admitted request waits for a thread.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

type Job = Box<dyn FnOnce() + Send>;

/// Why work sent to the pool gave no result.
#[derive(Debug, thiserror::Error)]
pub enum WorkError {
    #[error("the work panicked: {0}")]
    Panicked(String),
    #[error("the work pool has stopped")]
    Stopped,
}

/// A fixed set of threads taking work from one queue; they end when the pool is dropped
/// and the queue is empty.
pub struct WorkPool {
    jobs: crossbeam_channel::Sender<Job>,
    threads: usize,
}

impl WorkPool {
    /// Starts `threads` threads (at least one) named `{name}-{i}`, from this thread. A
    /// thread the system refuses to start is logged and left out; with none started, the
    /// work runs on tokio's blocking pool instead (at whatever priority it has).
    pub fn start(name: &str, threads: usize) -> Self {
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let mut started = 0;
        for i in 0..threads.max(1) {
            let queue = queue.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    while let Ok(job) = queue.recv() {
                        job();
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "cannot start a {name} thread"),
            }
        }
        Self {
            jobs,
            threads: started,
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `work` on one of the pool's threads and waits for its result without holding
    /// the caller's thread. A panic in `work` is its error; the thread goes on.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, WorkError> {
        if self.threads == 0 {
            return match tokio::task::spawn_blocking(work).await {
                Ok(value) => Ok(value),
                Err(e) if e.is_panic() => Err(WorkError::Panicked(panic_text(&*e.into_panic()))),
                Err(_) => Err(WorkError::Stopped),
            };
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(catch_unwind(AssertUnwindSafe(work)));
        });
        self.jobs.send(job).map_err(|_| WorkError::Stopped)?;
        match rx.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(panic)) => Err(WorkError::Panicked(panic_text(panic.as_ref()))),
            Err(_) => Err(WorkError::Stopped),
        }
    }
}

fn panic_text(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::priority::{lower_this_thread_once, this_thread_nice};

    #[tokio::test(flavor = "current_thread")]
    async fn work_runs_on_the_pool_and_a_panic_is_its_error() {
        let pool = WorkPool::start("test-work", 2);
        let name = pool
            .run(|| std::thread::current().name().map(str::to_string))
            .await
            .unwrap();
        assert!(name.is_some_and(|n| n.starts_with("test-work-")));
        let panicked = pool.run(|| -> u32 { panic!("planted") }).await;
        assert!(matches!(panicked, Err(WorkError::Panicked(ref m)) if m == "planted"));
        assert_eq!(
            pool.run(|| 7).await.unwrap(),
            7,
            "the thread survives a panic"
        );
    }

    #[test]
    fn work_sent_from_a_lowered_thread_runs_at_the_pools_priority() {
        let base = this_thread_nice().unwrap();
        let pool = std::sync::Arc::new(WorkPool::start("test-prio", 1));
        let sender = pool.clone();
        let (sent_from, ran_at) = std::thread::spawn(move || {
            lower_this_thread_once(5).unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let ran_at = runtime
                .block_on(sender.run(|| this_thread_nice().unwrap()))
                .unwrap();
            (this_thread_nice().unwrap(), ran_at)
        })
        .join()
        .unwrap();
        assert!(sent_from > base || base == 19, "the sender was lowered");
        assert_eq!(
            ran_at, base,
            "the work kept the priority of the pool's creator"
        );
    }
}
