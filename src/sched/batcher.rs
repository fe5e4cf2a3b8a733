//! The dynamic batcher of one device: after a replica takes a request, it adds what is
//! already waiting (in the queue's order), up to `max_batch`. An idle device (nothing else queued) runs the lone
//! request at once; only when a second request was already there does it wait up to
//! `max_wait_us` for more. It never holds a health check or a stop behind a batch.

use std::time::{Duration, Instant};

use super::job::Job;
use super::queue::{DeviceQueue, Wait, Work};
use super::Executor;
use crate::spec::BatchingSpec;

/// Builds a batch starting with `first`. `still_wanted` filters each added job (cancelled or
/// expired ones are answered and dropped there). Returns the batch and a non-job message
/// met on the way, which the caller handles next.
pub(crate) fn gather<E: Executor>(
    first: Job<E>,
    jobs: &DeviceQueue<E>,
    spec: &BatchingSpec,
    mut still_wanted: impl FnMut(Job<E>) -> Option<Job<E>>,
) -> (Vec<Job<E>>, Option<Work<E>>) {
    let mut batch = vec![first];
    if spec.max_batch <= 1 {
        return (batch, None);
    }
    // Set once the queue runs dry with two or more in hand: the device is under load.
    let mut wait_until: Option<Instant> = None;
    while batch.len() < spec.max_batch {
        // A batch's jobs are counted on the replica when it starts: a batching device's
        // admission is not planned run by run, so nothing reads the claim in between.
        let next = match wait_until {
            None => jobs.take(Wait::No, |_| ()),
            Some(until) => jobs.take(Wait::Until(until), |_| ()),
        };
        match next {
            Some(Work::Job(job)) => batch.extend(still_wanted(job)),
            Some(other) => return (batch, Some(other)),
            None if wait_until.is_none() && batch.len() > 1 && spec.max_wait_us > 0 => {
                wait_until = Some(Instant::now() + Duration::from_micros(spec.max_wait_us));
            }
            None => break,
        }
    }
    (batch, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::queue::Order;
    use crate::sched::state::DeviceState;
    use crate::sched::test_support::{device_state, job as priced, Echo};
    use std::sync::Arc;

    fn job(state: &Arc<DeviceState>, input: u32) -> Job<Echo> {
        priced(state, input, Duration::from_millis(1))
    }

    fn push(queue: &DeviceQueue<Echo>, job: Job<Echo>) -> bool {
        queue.push(job).is_ok()
    }

    const SPEC: BatchingSpec = BatchingSpec {
        max_batch: 3,
        // Long enough that a test would notice a wait, never reached when idle.
        max_wait_us: 50_000,
    };

    #[test]
    fn a_lone_request_runs_alone() {
        let state = device_state();
        let rx = DeviceQueue::<Echo>::new(Order::Fifo, 8);
        let (batch, deferred) = gather(job(&state, 1), &rx, &SPEC, Some);
        assert_eq!(batch.len(), 1);
        assert!(deferred.is_none());
    }

    #[test]
    fn waiting_requests_join_up_to_max_batch() {
        let state = device_state();
        let rx = DeviceQueue::new(Order::Fifo, 8);
        for i in 2..=5 {
            assert!(push(&rx, job(&state, i)));
        }
        let (batch, _) = gather(job(&state, 1), &rx, &SPEC, Some);
        let inputs: Vec<u32> = batch.iter().map(|j| j.input).collect();
        assert_eq!(inputs, [1, 2, 3]);
        assert_eq!(rx.len(), 2);
    }

    #[test]
    fn a_health_check_ends_the_batch_and_is_handed_back() {
        let state = device_state();
        let rx = DeviceQueue::new(Order::Fifo, 8);
        assert!(push(&rx, job(&state, 2)));
        rx.push_health_check();
        assert!(push(&rx, job(&state, 3)));
        // The queue hands out a pending health check before any job.
        let (batch, deferred) = gather(job(&state, 1), &rx, &SPEC, Some);
        assert_eq!(batch.len(), 1);
        assert!(matches!(deferred, Some(Work::HealthCheck)));
        assert_eq!(rx.len(), 2);
    }

    #[test]
    fn refused_jobs_are_left_out() {
        let state = device_state();
        let rx = DeviceQueue::new(Order::Fifo, 8);
        for i in 2..=4 {
            assert!(push(&rx, job(&state, i)));
        }
        let (batch, _) = gather(job(&state, 1), &rx, &SPEC, |j: Job<Echo>| {
            (j.input != 2).then_some(j)
        });
        let inputs: Vec<u32> = batch.iter().map(|j| j.input).collect();
        assert_eq!(inputs, [1, 3, 4]);
        // Dropped jobs give their count back.
        drop(batch);
        assert_eq!(
            state.outstanding.load(std::sync::atomic::Ordering::Acquire),
            0
        );
    }
}
