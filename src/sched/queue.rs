//! One device's queue: the jobs placed on it, a pending health check and the stops, taken
//! by its replicas. In arrival order (`Order::Fifo`, what a count-based router does), or
//! by the client's priority, then shortest expected first with aging, except that a job
//! a shorter one would make miss its deadline goes first (`Order::Cost`). A job that
//! cannot finish by its deadline is refused when it would be taken, not run.
//!
//! The queue holds at most its bound; the router's admission (by count) keeps it under.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::job::Job;
use super::{Executor, JobError};

/// How a device's replicas pick the next job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    Fifo,
    Cost,
}

/// What a replica takes from the queue.
pub(crate) enum Work<E: Executor> {
    Job(Job<E>),
    /// Run the executor's health check; a pass makes the device healthy.
    HealthCheck,
    /// One per replica at shutdown, once the queued jobs are taken.
    Stop,
}

/// How long `take` may wait for work.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wait {
    No,
    Until(Instant),
    Forever,
}

/// Why a job was not queued.
pub(crate) enum PushError<E: Executor> {
    Full(Job<E>),
    Closed(Job<E>),
}

struct Queued<E: Executor> {
    jobs: Vec<Job<E>>,
    health_check: bool,
    stops: usize,
    /// The router let go of the queue: replicas end once it is empty.
    closed: bool,
    /// Sum of the queued jobs' predicted costs.
    cost: Duration,
    /// Queued jobs priced by the prior, not a measured run (`Job::measured`).
    guessed: usize,
}

impl<E: Executor> Queued<E> {
    fn remove(&mut self, index: usize) -> Job<E> {
        let job = self.jobs.remove(index);
        self.cost = self.cost.saturating_sub(job.cost);
        self.guessed -= usize::from(!job.measured);
        job
    }
}

pub(crate) struct DeviceQueue<E: Executor> {
    queued: Mutex<Queued<E>>,
    ready: Condvar,
    order: Order,
    bound: usize,
}

/// A queued job as the order sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    pub priority: u8,
    pub enqueued: Instant,
    pub cost: Duration,
    /// Whether `cost` is measured: a job priced by the prior is refused only once its
    /// deadline has passed.
    pub measured: bool,
    pub deadline: Instant,
}

impl Entry {
    pub fn of<E: Executor>(job: &Job<E>) -> Self {
        Self {
            priority: job.priority,
            enqueued: job.enqueued,
            cost: job.cost,
            measured: job.measured,
            deadline: job.deadline,
        }
    }

    /// Shortest expected first, aged one for one by the time waited: a job enqueued at
    /// `t` with cost `c` is passed only by jobs with `t' + c' < t + c`, so no job that
    /// arrives after `t + c` minus the shortest cost can go before it: a long job waits
    /// at most for what arrived before that, never for ever.
    fn key(&self) -> Instant {
        self.enqueued + self.cost
    }

    /// The last moment it can start and still finish by its deadline.
    fn latest_start(&self) -> Option<Instant> {
        self.deadline.checked_sub(self.cost)
    }

    fn reachable(&self, now: Instant) -> bool {
        if self.measured {
            self.latest_start().is_some_and(|s| s >= now)
        } else {
            self.deadline >= now
        }
    }
}

/// What `pick` decided.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pick {
    /// Take the job at this index.
    Run(usize),
    /// Refuse the job at this index: it cannot finish by its deadline.
    Refuse(usize),
}

/// The next job under `Order::Cost`: any job that can no longer finish in time is refused
/// first; then, among the jobs of the most urgent priority (the smallest number), the one
/// with the earliest aged key, unless running it first would make another of them miss
/// its deadline: then the one of those that must start soonest.
pub(crate) fn pick<T>(queued: &[T], entry: impl Fn(&T) -> Entry, now: Instant) -> Option<Pick> {
    let entries = || queued.iter().map(&entry).enumerate();
    if let Some((late, _)) = entries().find(|(_, e)| !e.reachable(now)) {
        return Some(Pick::Refuse(late));
    }
    let top = entries().map(|(_, e)| e.priority).min()?;
    let (first, first_entry) = entries()
        .filter(|(_, e)| e.priority == top)
        .min_by_key(|(_, e)| e.key())?;
    let after_first = now + first_entry.cost;
    let at_risk = entries()
        .filter(|&(i, e)| i != first && e.priority == top)
        .filter(|(_, e)| e.latest_start().is_some_and(|s| s < after_first))
        .min_by_key(|(_, e)| e.latest_start())
        .map(|(i, _)| i);
    Some(Pick::Run(at_risk.unwrap_or(first)))
}

impl<E: Executor> DeviceQueue<E> {
    pub fn new(order: Order, bound: usize) -> Self {
        Self {
            queued: Mutex::new(Queued {
                jobs: Vec::new(),
                health_check: false,
                stops: 0,
                closed: false,
                cost: Duration::ZERO,
                guessed: 0,
            }),
            ready: Condvar::new(),
            order,
            bound: bound.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queued<E>> {
        self.queued.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, job: Job<E>) -> Result<(), PushError<E>> {
        let mut q = self.lock();
        if q.closed {
            return Err(PushError::Closed(job));
        }
        if q.jobs.len() >= self.bound {
            return Err(PushError::Full(job));
        }
        q.cost += job.cost;
        q.guessed += usize::from(!job.measured);
        q.jobs.push(job);
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    /// Asks a replica for a health check (one at a time: a second ask while one is
    /// pending is the same ask).
    pub fn push_health_check(&self) {
        self.lock().health_check = true;
        self.ready.notify_one();
    }

    /// One replica stops once the jobs queued now are taken.
    pub fn push_stop(&self) {
        self.lock().stops += 1;
        self.ready.notify_one();
    }

    /// The router is gone: replicas take what is left, then end.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    pub fn len(&self) -> usize {
        self.lock().jobs.len()
    }

    /// The predicted cost of the queued jobs that a new job of `entry`'s priority and
    /// key would run after: all of them in arrival order; by `pick`'s order otherwise
    /// (those of a more urgent priority, and those of its own with an earlier key).
    pub fn cost_ahead(&self, entry: &Entry) -> Duration {
        let q = self.lock();
        match self.order {
            Order::Fifo => q.cost,
            Order::Cost => q
                .jobs
                .iter()
                .map(Entry::of)
                .filter(|e| {
                    e.priority < entry.priority
                        || (e.priority == entry.priority && e.key() <= entry.key())
                })
                .map(|e| e.cost)
                .sum(),
        }
    }

    /// The predicted cost of every queued job.
    pub fn cost(&self) -> Duration {
        self.lock().cost
    }

    /// Whether a queued job is priced by the prior: then the queued cost is a guess.
    pub fn holds_guesses(&self) -> bool {
        self.lock().guessed > 0
    }

    /// Takes every queued job (a device marked unhealthy fails them over).
    pub fn drain_jobs(&self) -> Vec<Job<E>> {
        let mut q = self.lock();
        q.cost = Duration::ZERO;
        q.guessed = 0;
        std::mem::take(&mut q.jobs)
    }

    /// The next work: a pending health check first, then a job by the queue's order,
    /// then a stop once no job is left. `None` when nothing came within `wait`, or the
    /// queue is closed and empty.
    pub fn take(&self, wait: Wait) -> Option<Work<E>> {
        let mut q = self.lock();
        loop {
            if std::mem::take(&mut q.health_check) {
                return Some(Work::HealthCheck);
            }
            if let Some(job) = self.next_job(&mut q) {
                return Some(Work::Job(job));
            }
            if q.stops > 0 {
                q.stops -= 1;
                return Some(Work::Stop);
            }
            if q.closed {
                return None;
            }
            q = match wait {
                Wait::No => return None,
                Wait::Forever => self.ready.wait(q).unwrap_or_else(|p| p.into_inner()),
                Wait::Until(until) => {
                    let now = Instant::now();
                    if now >= until {
                        return None;
                    }
                    self.ready
                        .wait_timeout(q, until - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    fn next_job(&self, q: &mut Queued<E>) -> Option<Job<E>> {
        loop {
            if q.jobs.is_empty() {
                return None;
            }
            let index = match self.order {
                Order::Fifo => 0,
                Order::Cost => {
                    let now = Instant::now();
                    match pick(&q.jobs, Entry::of, now)? {
                        Pick::Run(i) => i,
                        Pick::Refuse(i) => {
                            let job = q.remove(i);
                            // Past its deadline, it expired as any request does; before
                            // it, the work ahead left it no time to finish.
                            let why = if job.deadline <= now {
                                JobError::DeadlineExceeded
                            } else {
                                JobError::DeadlineUnreachable
                            };
                            job.fail(why);
                            continue;
                        }
                    }
                }
            };
            // Arrival order is the vector's: removing keeps it.
            return Some(q.remove(index));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    struct At(Instant);
    impl At {
        fn entry(&self, priority: u8, enqueued_ms: u64, cost_ms: u64, deadline_ms: u64) -> Entry {
            Entry {
                priority,
                enqueued: self.0 + ms(enqueued_ms),
                cost: ms(cost_ms),
                measured: true,
                deadline: self.0 + ms(deadline_ms),
            }
        }
        fn t(&self, v: u64) -> Instant {
            self.0 + ms(v)
        }
    }

    const FAR: u64 = 600_000;

    #[test]
    fn the_most_urgent_priority_runs_first_whatever_its_size() {
        let at = At(Instant::now());
        let entries = [
            at.entry(5, 0, 10, FAR),
            at.entry(1, 5, 2000, FAR),
            at.entry(9, 1, 1, FAR),
        ];
        assert_eq!(pick(&entries, |e| *e, at.t(10)), Some(Pick::Run(1)));
    }

    #[test]
    fn a_short_job_passes_a_long_one_that_came_first() {
        let at = At(Instant::now());
        let entries = [at.entry(5, 0, 2000, FAR), at.entry(5, 100, 100, FAR)];
        assert_eq!(pick(&entries, |e| *e, at.t(150)), Some(Pick::Run(1)));
    }

    #[test]
    fn aging_bounds_how_long_a_long_job_waits() {
        // A 2 s job enqueued at 0 has key 2000: a 100 ms job passes it only when it came
        // before 1900 ms, whatever the time now.
        let at = At(Instant::now());
        let long = at.entry(5, 0, 2000, FAR);
        let before = [long, at.entry(5, 1899, 100, FAR)];
        assert_eq!(pick(&before, |e| *e, at.t(1900)), Some(Pick::Run(1)));
        let after = [long, at.entry(5, 1901, 100, FAR)];
        assert_eq!(pick(&after, |e| *e, at.t(1901)), Some(Pick::Run(0)));
        // Starvation bound, stated over a stream: small jobs arriving every 50 ms from
        // 0 ms; once the long one is picked, no job that came after 1900 ms ran before it.
        let mut queue = vec![long];
        let mut ran_before_long = Vec::new();
        let mut now = 0;
        let mut next_arrival = 0;
        loop {
            while next_arrival <= now {
                queue.push(at.entry(5, next_arrival, 100, FAR));
                next_arrival += 50;
            }
            let Some(Pick::Run(i)) = pick(&queue, |e| *e, at.t(now)) else {
                panic!("nothing to run")
            };
            let job = queue.remove(i);
            if job.cost == ms(2000) {
                break;
            }
            ran_before_long.push(job.enqueued);
            now += 100;
            assert!(now < 100_000, "the long job was starved");
        }
        assert!(ran_before_long.iter().all(|&t| t < at.t(1900)));
    }

    #[test]
    fn a_job_that_a_shorter_one_would_make_late_goes_first() {
        let at = At(Instant::now());
        // The long job must start by 1000 ms (deadline 3000, cost 2000); running the
        // 300 ms one first at 800 would start it at 1100.
        let entries = [at.entry(5, 0, 2000, 3000), at.entry(5, 700, 300, FAR)];
        assert_eq!(pick(&entries, |e| *e, at.t(800)), Some(Pick::Run(0)));
        // At 600 there is room for both in the other order.
        assert_eq!(pick(&entries, |e| *e, at.t(600)), Some(Pick::Run(1)));
    }

    #[test]
    fn a_job_that_cannot_finish_in_time_is_refused_not_run() {
        let at = At(Instant::now());
        let entries = [at.entry(5, 0, 100, FAR), at.entry(5, 0, 500, 1000)];
        assert_eq!(pick(&entries, |e| *e, at.t(600)), Some(Pick::Refuse(1)));
        assert_eq!(pick(&entries, |e| *e, at.t(400)), Some(Pick::Run(0)));
        assert_eq!(pick(&[], |e: &Entry| *e, at.t(0)), None);
    }

    #[test]
    fn a_job_priced_by_the_prior_is_refused_only_past_its_deadline() {
        let at = At(Instant::now());
        let guessed = Entry {
            measured: false,
            ..at.entry(5, 0, 500, 1000)
        };
        assert_eq!(pick(&[guessed], |e| *e, at.t(600)), Some(Pick::Run(0)));
        assert_eq!(pick(&[guessed], |e| *e, at.t(1001)), Some(Pick::Refuse(0)));
    }
}
