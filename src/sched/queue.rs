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
use super::terms::Terms;
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

/// How many of its own run times a job may be passed by shorter ones that came after it:
/// a job is passed only by those that came within `STRETCH` times the difference of
/// their prices after it. Aged one for one (1), where the sizes cost 1.6x apart (U2NetP's
/// INT8 variant on the CPU, 175 against 280 ms) that window was 0.1 s, less than either
/// waits behind a busy device, and the queue ran in arrival order. At 16 it was 1.7 s
/// there, but 1.4 s for the FP32 model (440 ms at 320x320, 530 ms at 12 MP: 1.2x), less
/// than the 2.2 s a 12 MP request waited, so most small requests still queued behind the
/// large ones that came before them. At 64 (5.8 s there) the 12 MP requests are answered
/// in 3.4 s against 2.0 s in arrival order: the wait reordering adds stays bounded by the
/// difference of the prices, and a deadline bounds it sooner. Strict shortest-first
/// (1000) held some to their deadlines (10 s).
const STRETCH: u32 = 64;

/// A queued job as the order sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    pub priority: u8,
    pub enqueued: Instant,
    pub cost: Duration,
    /// Whether `cost` is measured: a job priced by the prior is refused only once its
    /// deadline has passed.
    pub measured: bool,
    /// What its run may take at worst (`Job::worst`): when it must start by.
    pub worst: Duration,
    pub deadline: Instant,
}

impl Entry {
    pub fn of<E: Executor>(job: &Job<E>) -> Self {
        Self {
            priority: job.priority,
            enqueued: job.enqueued,
            cost: job.cost,
            // A probe's price is what it is sent to test: refused, as a guess is, only
            // once its deadline has passed.
            measured: job.measured && !job.probe,
            worst: job.worst,
            deadline: job.deadline,
        }
    }

    /// A request of `terms` as a queue would order it, placed at `now` priced at `cost`
    /// (`worst` at worst).
    pub fn placed(
        terms: &Terms,
        cost: Duration,
        measured: bool,
        worst: Duration,
        now: Instant,
    ) -> Self {
        Self {
            priority: terms.priority.level(),
            enqueued: now,
            cost,
            measured,
            worst,
            deadline: terms.run_deadline(),
        }
    }

    /// Shortest expected first, aged by the time waited: a job enqueued at `t` with cost
    /// `c` is passed only by jobs with `t' + STRETCH x c' < t + STRETCH x c`, so no job
    /// that arrives after `t + STRETCH x c` can go before it: a long job waits at most for
    /// what arrived within `STRETCH` of its own run times after it, never for ever (and
    /// never past its deadline: `pick` runs a job the others would make late first).
    /// A job priced by a guess (the prior, an extrapolation) is aged one for one: the
    /// stretch would multiply the guess's error, and a 12 MP photo priced by a 320x320
    /// run at 5 s was passed for 80 s, until its deadline put it first.
    fn key(&self) -> Instant {
        let stretch = if self.measured { STRETCH } else { 1 };
        self.enqueued + self.cost * stretch
    }

    /// The last moment it can start and still finish by its deadline, if its run takes
    /// as long as it may (`worst`).
    fn latest_start(&self) -> Option<Instant> {
        self.deadline.checked_sub(self.worst)
    }

    /// Whether a run that ends at `end` is in time.
    pub fn meets(&self, end: Instant) -> bool {
        end <= self.deadline
    }

    /// Whether it can still finish by its deadline, if its run takes what it is priced
    /// at: refused only when even that is too late.
    fn reachable(&self, now: Instant) -> bool {
        if self.measured {
            self.deadline
                .checked_sub(self.cost)
                .is_some_and(|s| s >= now)
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
/// its deadline (were both runs as slow as they may be): then the one of those that
/// must start soonest.
pub(crate) fn pick<T>(queued: &[T], entry: impl Fn(&T) -> Entry, now: Instant) -> Option<Pick> {
    let entries = || queued.iter().map(&entry).enumerate();
    if let Some((late, _)) = entries().find(|(_, e)| !e.reachable(now)) {
        return Some(Pick::Refuse(late));
    }
    let top = entries().map(|(_, e)| e.priority).min()?;
    let (first, first_entry) = entries()
        .filter(|(_, e)| e.priority == top)
        .min_by_key(|(_, e)| e.key())?;
    // The first's run may take its worst too: a late start is missed as a slow run is.
    let after_first = now + first_entry.worst;
    let at_risk = entries()
        .filter(|&(i, e)| i != first && e.priority == top)
        .filter(|(_, e)| e.latest_start().is_some_and(|s| s < after_first))
        .min_by_key(|(_, e)| e.latest_start());
    match at_risk {
        // The first must start sooner than the one it would make late: run first, that
        // one would make the first the late one.
        Some((i, e)) if e.latest_start() < first_entry.latest_start() => Some(Pick::Run(i)),
        _ => Some(Pick::Run(first)),
    }
}

/// When each of `entries` would end, were the device's replicas, free at `free_at`, to
/// take them from then on in `pick`'s order, each run taking what it may at worst
/// (`Entry::worst`). A job `pick` would refuse runs on no replica; its end is what it
/// would have been had it run when refused, past its deadline. Admission plans a
/// device's queue with a new job and without it (`fit`): `pick` looks one run ahead, and
/// a job that jumps the queue because its deadline is near, or a start later than the
/// shared wait, made requests that were admitted in time miss their deadline.
pub(crate) fn plan(entries: &[Entry], free_at: &[Instant]) -> Vec<Instant> {
    let mut ends: Vec<Option<Instant>> = vec![None; entries.len()];
    let mut free = free_at.to_vec();
    let mut left: Vec<usize> = (0..entries.len()).collect();
    while let Some((replica, &at)) = free.iter().enumerate().min_by_key(|(_, at)| **at) {
        let (k, runs) = match pick(&left, |&i| entries[i], at) {
            Some(Pick::Run(k)) => (k, true),
            Some(Pick::Refuse(k)) => (k, false),
            None => break,
        };
        let job = left.remove(k);
        let end = at + entries[job].worst;
        ends[job] = Some(end);
        if runs {
            free[replica] = end;
        }
    }
    // Every job is planned once a replica is free; without one (none given), at once.
    let now = free_at.iter().min().copied();
    entries
        .iter()
        .zip(ends)
        .map(|(e, end)| end.unwrap_or_else(|| now.unwrap_or(e.enqueued) + e.worst))
        .collect()
}

/// What a new job does to a device's plan (`fit`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fit {
    /// It, and every queued job that was planned to finish in time, finish in time.
    Fits,
    /// It would end then, after its deadline.
    Late(Instant),
    /// It would make a queued job late, of its priority or a more urgent one; those are
    /// planned to have started by `until` without it.
    Harms { until: Instant },
}

/// Whether a device holding `queued`, its replicas free at `free_at`, can take `new`
/// (placed now): planned with it and without it (`plan`), it must finish in time, and so
/// must every queued job of its priority or a more urgent one that finished in time
/// without it. A more urgent job may still make a less urgent one late: that is what a
/// priority asks for.
pub(crate) fn fit(queued: &[Entry], new: Entry, free_at: &[Instant]) -> Fit {
    let without = plan(queued, free_at);
    let mut entries = queued.to_vec();
    entries.push(new);
    let with = plan(&entries, free_at);
    let own = with[queued.len()];
    if !new.meets(own) {
        return Fit::Late(own);
    }
    // Once the jobs it would make late have started, it could pass them no more.
    let harmed = queued
        .iter()
        .zip(without.iter().zip(&with))
        .filter(|(e, _)| e.priority <= new.priority)
        .filter(|(e, (before, after))| e.meets(**before) && !e.meets(**after))
        .map(|(e, (before, _))| *before - e.worst)
        .max();
    match harmed {
        Some(until) => Fit::Harms { until },
        None => Fit::Fits,
    }
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

    /// The queued jobs as the order sees them, in arrival order.
    pub fn entries(&self) -> Vec<Entry> {
        self.lock().jobs.iter().map(Entry::of).collect()
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
    /// queue is closed and empty. `claim` sees a job before the queue lets go of it
    /// (`DeviceState::claim`): whoever reads the queue after the take finds the job's
    /// replica busy.
    pub fn take(&self, wait: Wait, claim: impl FnOnce(&Job<E>)) -> Option<Work<E>> {
        let mut q = self.lock();
        loop {
            if std::mem::take(&mut q.health_check) {
                return Some(Work::HealthCheck);
            }
            if let Some(job) = self.next_job(&mut q) {
                claim(&job);
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
                worst: ms(cost_ms),
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

    /// Runs a stream of 100 ms jobs, one every 50 ms from 0 ms (twice what one replica
    /// does), with `long` queued at 0, until `long` is picked: when it started, and when
    /// the jobs that ran before it came.
    fn stream_until_picked(at: &At, long: Entry) -> (u64, Vec<Instant>) {
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
            if job.cost == long.cost {
                return (now, ran_before_long);
            }
            ran_before_long.push(job.enqueued);
            now += 100;
            assert!(now < 1_000_000, "the long job was starved");
        }
    }

    #[test]
    fn aging_bounds_how_long_a_long_job_waits() {
        // A 2 s job enqueued at 0 has key STRETCH x 2000: a 100 ms job passes it only when
        // it came before STRETCH x (2000 - 100) ms, whatever the time now.
        let limit = u64::from(STRETCH) * (2000 - 100);
        let at = At(Instant::now());
        let long = at.entry(5, 0, 2000, FAR);
        // Well beyond the difference of their run times (aged one for one, 1.9 s).
        let before = [long, at.entry(5, limit - 1, 100, FAR)];
        assert_eq!(pick(&before, |e| *e, at.t(limit)), Some(Pick::Run(1)));
        let after = [long, at.entry(5, limit + 1, 100, FAR)];
        assert_eq!(pick(&after, |e| *e, at.t(limit + 1)), Some(Pick::Run(0)));
        // Starvation bound, stated over a stream: once the long one is picked, no job
        // that came after the limit ran before it.
        let (_, ran_before_long) = stream_until_picked(&at, long);
        assert!(ran_before_long.iter().all(|&t| t < at.t(limit)));
        assert!(ran_before_long.len() > 100, "the short jobs went first");
    }

    #[test]
    fn a_job_priced_by_a_guess_is_aged_one_for_one() {
        // Both priced by the prior, as at a cold start.
        let at = At(Instant::now());
        let guessed = |enqueued, cost| Entry {
            measured: false,
            ..at.entry(5, enqueued, cost, FAR)
        };
        let before = [guessed(0, 2000), guessed(1899, 100)];
        assert_eq!(pick(&before, |e| *e, at.t(1900)), Some(Pick::Run(1)));
        let after = [guessed(0, 2000), guessed(1901, 100)];
        assert_eq!(pick(&after, |e| *e, at.t(1901)), Some(Pick::Run(0)));
    }

    #[test]
    fn a_deadline_bounds_a_long_jobs_wait_sooner_than_aging() {
        // Due by 5 s, the same long job starts by 3 s however many short jobs come.
        let at = At(Instant::now());
        let (started, ran_before_long) = stream_until_picked(&at, at.entry(5, 0, 2000, 5000));
        assert!(started <= 3000, "started at {started} ms");
        assert!(
            !ran_before_long.is_empty(),
            "short jobs went first while it could wait"
        );
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
    fn of_two_jobs_that_would_each_make_the_other_late_the_one_due_to_start_first_runs() {
        let at = At(Instant::now());
        // The short job must start by 50 ms, the long one by 80: the short one first
        // (by key) starts the long one at 100, but the long one first would start the
        // short one at 200. The one that must start sooner runs.
        let short = at.entry(5, 0, 100, 150);
        let long = at.entry(5, 0, 200, 280);
        assert_eq!(pick(&[long, short], |e| *e, at.t(0)), Some(Pick::Run(1)));
        // Were the short one to start by 220 instead, it could wait for the long one,
        // which could not wait for it: the long one runs.
        let later = at.entry(5, 0, 100, 320);
        assert_eq!(pick(&[long, later], |e| *e, at.t(0)), Some(Pick::Run(0)));
    }

    #[test]
    fn a_job_goes_first_by_what_its_run_may_take_at_worst() {
        let at = At(Instant::now());
        // Priced at 2000 ms, it must start by 1000; but runs lately took up to 1.25x
        // their price, so by 500. At 300 the 300 ms job would start it at 600.
        let slow = Entry {
            worst: ms(2500),
            ..at.entry(5, 0, 2000, 3000)
        };
        let entries = [slow, at.entry(5, 200, 300, FAR)];
        assert_eq!(pick(&entries, |e| *e, at.t(300)), Some(Pick::Run(0)));
        // Priced alone it could wait: the short job goes first.
        let priced = [at.entry(5, 0, 2000, 3000), at.entry(5, 200, 300, FAR)];
        assert_eq!(pick(&priced, |e| *e, at.t(300)), Some(Pick::Run(1)));
        // Past the worst run's start it is still run, not refused, while its price fits.
        assert_eq!(pick(&[slow], |e| *e, at.t(900)), Some(Pick::Run(0)));
    }

    #[test]
    fn a_job_goes_first_if_the_shorter_ones_slowest_run_would_make_it_late() {
        let at = At(Instant::now());
        // The long job must start by 1000 ms. At 500 the 300 ms job, run first, ends at
        // 800 on its price, at 1100 if it takes what its device's runs lately took (2x).
        let short = Entry {
            worst: ms(600),
            ..at.entry(5, 400, 300, FAR)
        };
        let entries = [at.entry(5, 0, 2000, 3000), short];
        assert_eq!(pick(&entries, |e| *e, at.t(500)), Some(Pick::Run(0)));
        let priced = [at.entry(5, 0, 2000, 3000), at.entry(5, 400, 300, FAR)];
        assert_eq!(pick(&priced, |e| *e, at.t(500)), Some(Pick::Run(1)));
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

    #[test]
    fn a_plan_gives_each_job_to_the_replica_free_first_in_picks_order() {
        let at = At(Instant::now());
        // Shortest first: B (100 ms) on the replica free at 0, then C (200) and A (300)
        // on the two free at 100, C on the first of them.
        let entries = [
            at.entry(5, 0, 300, FAR),
            at.entry(5, 10, 100, FAR),
            at.entry(5, 20, 200, FAR),
        ];
        assert_eq!(
            plan(&entries, &[at.t(0), at.t(100)]),
            vec![at.t(400), at.t(100), at.t(300)]
        );
        // Each run takes what it may at worst.
        let slow = Entry {
            worst: ms(250),
            ..at.entry(5, 10, 100, FAR)
        };
        assert_eq!(plan(&[slow], &[at.t(50)]), vec![at.t(300)]);
    }

    #[test]
    fn a_job_pick_would_refuse_takes_no_replica_in_a_plan() {
        let at = At(Instant::now());
        // Free at 500, a 100 ms job due at 400 is refused, planned to end at 600 had it
        // run; the other runs from 500.
        let entries = [at.entry(5, 0, 100, 400), at.entry(5, 0, 100, FAR)];
        let ends = plan(&entries, &[at.t(500)]);
        assert_eq!(ends, vec![at.t(600), at.t(600)]);
        assert!(!entries[0].meets(ends[0]) && entries[1].meets(ends[1]));
        assert_eq!(plan(&[], &[at.t(0)]), Vec::<Instant>::new());
    }

    #[test]
    fn a_job_that_would_run_first_and_make_a_queued_one_late_does_not_fit() {
        let at = At(Instant::now());
        let free = [at.t(100)];
        // The new job must start by 350 and the queued one, priced alike, came first:
        // `pick` runs the new one first (it is at risk), and the queued one then ends at
        // 700, past 690; it was planned to start at 100.
        let new = at.entry(5, 50, 300, 650);
        let queued = [at.entry(5, 0, 300, 690)];
        assert_eq!(fit(&queued, new, &free), Fit::Harms { until: at.t(100) });
        // Due at 700, it still ends in time.
        assert_eq!(fit(&[at.entry(5, 0, 300, 700)], new, &free), Fit::Fits);
        // A more urgent job may make it late: it asked to go first.
        let urgent = Entry { priority: 1, ..new };
        assert_eq!(fit(&queued, urgent, &free), Fit::Fits);
        // A queued job that is late without it is no reason to refuse it; one it makes
        // late beside that is.
        let late_anyway = at.entry(5, 0, 300, 390);
        assert_eq!(fit(&[late_anyway], new, &free), Fit::Fits);
        assert_eq!(
            fit(&[late_anyway, queued[0]], new, &[at.t(100), at.t(2000)]),
            Fit::Harms { until: at.t(100) }
        );
    }

    #[test]
    fn a_job_planned_to_end_after_its_deadline_is_late() {
        let at = At(Instant::now());
        // Priced at 200 ms it could end by 380 from 100; at worst (300 ms) it ends at 400.
        let new = Entry {
            worst: ms(300),
            ..at.entry(5, 50, 200, 380)
        };
        assert_eq!(fit(&[], new, &[at.t(100)]), Fit::Late(at.t(400)));
        // Behind a replica free only at 200, even its price is too late: refused then.
        assert_eq!(fit(&[], new, &[at.t(200)]), Fit::Late(at.t(500)));
        // With a replica free at once, it fits.
        assert_eq!(fit(&[], new, &[at.t(50), at.t(200)]), Fit::Fits);
    }

    /// A replica claims what it takes (`DeviceState::claim`) before the queue lets go of
    /// it: a plan of the device made after the take finds the job on the replica, never
    /// in neither place.
    #[test]
    fn a_taken_job_is_claimed_while_the_queue_still_holds_its_lock() {
        use crate::sched::test_support::{device_state, job, Echo};

        let state = device_state();
        let queue = DeviceQueue::<Echo>::new(Order::Cost, 4);
        assert!(queue.push(job(&state, 7, ms(300))).is_ok());
        let mut claimed = None;
        let taken = queue.take(Wait::No, |job| {
            claimed = Some((job.input, queue.queued.try_lock().is_err()));
            state.claim(0, job.cost, Instant::now());
        });
        assert!(matches!(taken, Some(Work::Job(ref job)) if job.input == 7));
        assert_eq!(claimed, Some((7, true)), "claimed under the queue's lock");
        assert!(queue.entries().is_empty());
        assert!(state.running_left() > Duration::ZERO, "the replica is busy");
        state.unclaim(0);
        assert_eq!(state.running_left(), Duration::ZERO);
    }
}
