//! One replica: an OS thread that loads its executor, then takes work from its device's
//! queue (any idle replica takes the next request), skips what nobody waits for or what
//! expired, batches under load, runs, replies through oneshot channels and updates the
//! device's figures. A panic costs the batch, never the thread.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::batcher::gather;
use super::executor::{LoadFn, WarmRun};
use super::job::Job;
use super::metrics::us;
use super::queue::{DeviceQueue, Wait, Work};
use super::state::DeviceState;
use super::{Done, Executor, JobError, Recovery};
use crate::spec::BatchingSpec;

/// How a run went, as its answers and the cost model read it.
struct Ran {
    started: Instant,
    compute: Duration,
    /// The watchdog reported it stuck: its time is a stall's, not its work's.
    stalled: bool,
}

pub(crate) struct ReplicaConfig<E> {
    pub index: usize,
    pub load: LoadFn<E>,
    pub batching: BatchingSpec,
    pub unhealthy_after_failures: u32,
}

/// Starts replica `config.index` of `state`'s device on its own thread.
pub(crate) fn spawn<E: Executor>(
    state: Arc<DeviceState>,
    config: ReplicaConfig<E>,
    jobs: Arc<DeviceQueue<E>>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("celer-{}-{}", state.name, config.index))
        .spawn(move || {
            let index = config.index;
            let loaded = std::panic::catch_unwind(AssertUnwindSafe(|| (config.load)(index)));
            let mut exec = match loaded {
                Ok(Ok(exec)) => exec,
                Ok(Err(e)) => return load_failed(&state, index, e.to_string()),
                Err(panic) => return load_failed(&state, index, panic_message(panic.as_ref())),
            };
            let warmed = std::panic::catch_unwind(AssertUnwindSafe(|| exec.warm_up()));
            match warmed {
                Ok(Ok(runs)) => learn_from_warm_up(&state, &runs),
                Ok(Err(e)) => return load_failed(&state, index, format!("warm-up: {e}")),
                Err(panic) => {
                    let why = panic_message(panic.as_ref());
                    return load_failed(&state, index, format!("warm-up: {why}"));
                }
            }
            if exec.stuck_is_lost() {
                state.stuck_is_lost.store(true, Ordering::Release);
            }
            state.loaded.fetch_add(1, Ordering::AcqRel);
            tracing::debug!(device = %state.name, replica = index, "replica ready");
            Replica {
                exec,
                state,
                index,
                load: config.load,
                batching: config.batching,
                unhealthy_after_failures: config.unhealthy_after_failures,
                panicked: false,
            }
            .serve(&jobs);
        })
}

/// The warm-up's runs priced as requests' runs are: the device's first prices come from
/// warm runs, not from the first requests, which pay for what a first run does.
fn learn_from_warm_up(state: &DeviceState, runs: &[WarmRun]) {
    for run in runs {
        state.record_success(run.took);
        state.cost.observe(run.work, run.took, run.parts);
    }
    if !runs.is_empty() {
        state.note_run_ended();
    }
}

fn load_failed(state: &DeviceState, replica: usize, error: String) {
    tracing::error!(device = %state.name, replica, error = %error, "replica failed to load");
    state
        .load_error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert(error);
    // No traffic to a device that cannot run it: requests get a 503 at once instead of
    // waiting in a queue no replica serves until their deadline.
    state.mark_unhealthy("a replica failed to load its models");
}

struct Replica<E: Executor> {
    exec: E,
    state: Arc<DeviceState>,
    index: usize,
    /// Loads a fresh executor when this one panicked (its state is not to be trusted).
    load: LoadFn<E>,
    batching: BatchingSpec,
    unhealthy_after_failures: u32,
    /// The executor panicked: replace it before the next run.
    panicked: bool,
}

impl<E: Executor> Replica<E> {
    fn serve(mut self, jobs: &DeviceQueue<E>) {
        let mut next: Option<Work<E>> = None;
        loop {
            let work = match next.take() {
                Some(work) => work,
                None => match self.take(jobs) {
                    Some(work) => work,
                    // Closed and empty: the router was dropped.
                    None => return,
                },
            };
            match work {
                Work::Stop => return,
                Work::HealthCheck => self.health_check(),
                Work::Job(job) => {
                    let Some(first) = self.still_wanted(job) else {
                        self.state.unclaim(self.index);
                        continue;
                    };
                    let (batch, deferred) =
                        gather(first, jobs, &self.batching, |j| self.still_wanted(j));
                    next = deferred;
                    let waiting = jobs.len() + usize::from(next.is_some());
                    self.execute(batch, waiting);
                }
            }
            if self.panicked {
                self.replace();
            }
        }
    }

    /// A run or health check panicked: whatever the executor held (sessions, scratch,
    /// device buffers) may be half-updated, so it is dropped and a fresh one loaded on
    /// this thread, as at start-up. The other replicas serve meanwhile. A failed load
    /// keeps the old executor (better a suspect replica than none) and is retried after
    /// the next panic.
    fn replace(&mut self) {
        self.panicked = false;
        let state = self.state.clone();
        let started = Instant::now();
        let load = self.load.clone();
        let index = self.index;
        match std::panic::catch_unwind(AssertUnwindSafe(|| load(index))) {
            Ok(Ok(fresh)) => {
                self.exec = fresh;
                state.metrics.replacements.inc();
                tracing::warn!(
                    device = %state.name,
                    replica = index,
                    seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
                    "replica replaced after a panic"
                );
            }
            Ok(Err(e)) => {
                tracing::error!(device = %state.name, replica = index, error = %e, "replacing the replica after a panic failed; it keeps its executor")
            }
            Err(panic) => tracing::error!(
                device = %state.name,
                replica = index,
                error = %panic_message(panic.as_ref()),
                "replacing the replica after a panic panicked; it keeps its executor"
            ),
        }
    }

    /// The queue's next work, waiting for it; a job is this replica's from the take on.
    fn take(&self, jobs: &DeviceQueue<E>) -> Option<Work<E>> {
        jobs.take(Wait::Forever, |job| {
            self.state.claim(self.index, job.cost, Instant::now())
        })
    }

    /// The job if it should run: not when its client went away (its handler was
    /// dropped), its deadline passed, or the device was marked unhealthy meanwhile.
    fn still_wanted(&self, job: Job<E>) -> Option<Job<E>> {
        if job.reply.is_closed() {
            self.state.metrics.cancelled.inc();
            return None;
        }
        if Instant::now() >= job.deadline {
            job.fail(JobError::DeadlineExceeded);
            return None;
        }
        if !self.state.is_healthy() {
            job.fail(JobError::DeviceUnhealthy {
                device: self.state.name.clone(),
            });
            return None;
        }
        Some(job)
    }

    /// Runs `batch`, `waiting` requests queued behind it.
    fn execute(&mut self, batch: Vec<Job<E>>, waiting: usize) {
        let n = batch.len();
        let state = self.state.clone();
        let started = Instant::now();
        let Some(guessed) = self.begin_run(&batch, started) else {
            return;
        };

        let inputs: Vec<&E::Input> = batch.iter().map(|j| &j.input).collect();
        let exec = &mut self.exec;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            exec.note_waiting(waiting);
            exec.run_batch(&inputs)
        }));
        drop(inputs);
        let compute = started.elapsed();

        let stalled = self.end_run(n, guessed, started, compute);

        let mut lost = None;
        let error = match result {
            Ok(Ok(outputs)) if outputs.len() == n => {
                self.answer(
                    batch,
                    outputs,
                    Ran {
                        started,
                        compute,
                        stalled,
                    },
                );
                return;
            }
            Ok(Ok(outputs)) => JobError::Failed {
                device: state.name.clone(),
                reason: format!(
                    "the executor returned {} outputs for {n} inputs",
                    outputs.len()
                ),
            },
            Ok(Err(e)) => {
                if e.is_device_lost() {
                    lost = Some(e.to_string());
                }
                JobError::Failed {
                    device: state.name.clone(),
                    reason: e.to_string(),
                }
            }
            Err(panic) => {
                self.panicked = true;
                JobError::Panicked {
                    device: state.name.clone(),
                    what: panic_message(panic.as_ref()),
                }
            }
        };
        tracing::warn!(device = %state.name, replica = self.index, batch = n, error = %error, "batch failed");
        state.record_failure(self.unhealthy_after_failures);
        for job in batch {
            job.fail(error.clone());
        }
        if let Some(why) = lost {
            self.recover(&why);
        }
    }

    /// Puts a run of `batch`, beginning at `started`, on the device's account (the
    /// watchdog's deadline, its price, the requests running) and says whether its price
    /// was guessed; none for an empty batch.
    fn begin_run(&self, batch: &[Job<E>], started: Instant) -> Option<bool> {
        let state = &self.state;
        let m = &state.metrics;
        let earliest = batch.iter().map(|j| j.server_deadline).min()?;
        for job in batch {
            m.queue_us.observe(us(started - job.enqueued));
        }
        // The watchdog reads this to catch a run that overruns the server's deadline (a
        // stuck device; a client's sooner one only makes the answer late).
        let running = &state.running_deadline_ns[self.index];
        running.store(state.instant_ns(earliest), Ordering::Release);
        let priced: Duration = batch.iter().map(|j| j.cost).sum();
        let guessed = batch.iter().any(|j| !j.measured);
        if guessed {
            state.running_guesses.fetch_add(1, Ordering::AcqRel);
        }
        state.claim(self.index, priced, started);
        state.running.fetch_add(batch.len(), Ordering::AcqRel);
        Some(guessed)
    }

    /// Takes a run of `n` requests, begun at `started`, off the device's account, and says
    /// whether the watchdog reported it stuck (`Ran::stalled`).
    fn end_run(&self, n: usize, guessed: bool, started: Instant, compute: Duration) -> bool {
        let state = &self.state;
        let m = &state.metrics;
        let running = &state.running_deadline_ns[self.index];
        state.unclaim(self.index);
        if guessed {
            state.running_guesses.fetch_sub(1, Ordering::AcqRel);
        }
        state.running.fetch_sub(n, Ordering::AcqRel);
        // A run the watchdog reported stuck stalled past the server's deadline: its time
        // is the stall's, not the price of its work, so the cost model does not learn it
        // (one stall would otherwise price the device's next requests at seconds and
        // admission would refuse them as unreachable).
        let stalled = running.swap(0, Ordering::AcqRel) == 0;
        if stalled {
            // The watchdog reported this run as stuck; it has ended.
            let stuck = state.stuck.fetch_sub(1, Ordering::AcqRel).saturating_sub(1);
            m.stuck.set(stuck as i64);
            tracing::info!(device = %state.name, replica = self.index, seconds = format!("{:.2}", started.elapsed().as_secs_f64()), "a run that went past its deadline ended");
        }
        m.compute_us.observe(us(compute));
        m.batch_size.observe(n as f64);
        m.exec_count.inc();
        stalled
    }

    /// A run's outputs, one per job of `batch`: the cost model learns their price (not
    /// a stalled run's) and each job gets its answer.
    fn answer(&self, batch: Vec<Job<E>>, outputs: Vec<E::Output>, ran: Ran) {
        let state = &self.state;
        let n = batch.len();
        let per_request = ran.compute / n as u32;
        if ran.stalled {
            state.record_success_untimed();
        } else {
            state.record_success(per_request);
        }
        state.note_run_ended();
        if !ran.stalled {
            self.learn(&batch, &outputs, per_request);
        }
        for (job, output) in batch.into_iter().zip(outputs) {
            let _ = job.reply.send(Ok(Done {
                output,
                device: state.index,
                queued: ran.started - job.enqueued,
                started: ran.started,
                compute: ran.compute,
                batch_size: n,
                failed_over: false,
            }));
        }
    }

    /// The cost model learns what each request of a run cost (`per_request`, the run's
    /// time shared), with its stages' parts where the executor reports them.
    fn learn(&self, batch: &[Job<E>], outputs: &[E::Output], per_request: Duration) {
        let state = &self.state;
        let n = batch.len() as u32;
        for (job, output) in batch.iter().zip(outputs) {
            if job.probe {
                state
                    .cost
                    .restart_if_overpriced(job.cost, job.worst, per_request);
            }
            // A batch's model stage is the batch's: each request's share of it.
            let parts = self.exec.parts(output).map(|p| super::RunParts {
                fixed: p.fixed / n,
                ..p
            });
            state.cost.observe(job.work, per_request, parts);
            if job.measured {
                state.cost.observe_overrun(job.cost, per_request);
            }
        }
    }

    /// The device is lost: no traffic (requests queued on it fail over), then the
    /// executor reopens it; the watchdog's next passing health check returns it to service.
    fn recover(&mut self, why: &str) {
        let state = self.state.clone();
        state.mark_unhealthy("the device is lost (its context failed)");
        tracing::warn!(device = %state.name, replica = self.index, error = %why, "device lost: reopening it where it can come back in this process");
        let started = Instant::now();
        let exec = &mut self.exec;
        match std::panic::catch_unwind(AssertUnwindSafe(|| exec.recover())) {
            Ok(Ok(Recovery::AlreadyReopened)) => {
                tracing::info!(device = %state.name, replica = self.index, "device already reopened by another replica")
            }
            Ok(Ok(Recovery::NeedsRestart(reason))) => {
                if state.mark_lost_for_good(&format!("{why}; {reason}")) {
                    tracing::error!(
                        device = %state.name,
                        error = %why,
                        reason = %reason,
                        "GPU lost: it cannot come back in this process; out of service, and the server restarts"
                    );
                }
            }
            Ok(Ok(Recovery::Reopened)) => {
                state.metrics.recoveries.inc();
                tracing::info!(
                    device = %state.name,
                    seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
                    "device reopened and reloaded; back in service once a health check passes"
                );
            }
            Ok(Err(e)) => {
                tracing::error!(device = %state.name, error = %e, "recovery failed; tried again after the next failed health check")
            }
            Err(panic) => tracing::error!(
                device = %state.name,
                error = %panic_message(panic.as_ref()),
                "recovery panicked; tried again after the next failed health check"
            ),
        }
    }

    fn health_check(&mut self) {
        let exec = &mut self.exec;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| exec.health_check()));
        self.state
            .health_check_pending
            .store(false, Ordering::Release);
        match result {
            Ok(Ok(())) => self.state.mark_healthy(),
            Ok(Err(e)) if e.is_device_lost() => self.recover(&e.to_string()),
            Ok(Err(e)) => {
                tracing::warn!(device = %self.state.name, error = %e, "health check failed; device stays unhealthy")
            }
            Err(panic) => {
                self.panicked = true;
                tracing::warn!(
                    device = %self.state.name,
                    error = %panic_message(panic.as_ref()),
                    "health check panicked; device stays unhealthy"
                )
            }
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}
