//! Simulated devices, for tests and capacity planning (`celer sim`) only; `serve` never
//! builds them. A simulated replica sleeps for a service time (a fixed part, the models,
//! plus a part per megapixel of the request) times a lognormal draw, divided by its
//! device's speed, on a real replica thread behind the real router, queues and batcher:
//! what the load generator measures is the scheduler. Time is wall time, so keep service
//! times small (a median of a few milliseconds).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cost::{RunParts, Work};
use super::scheduler::{DeviceSetup, Scheduler};
use super::terms::Terms;
use super::{ExecError, Executor, JobError, SubmitError};
use crate::spec::BatchingSpec;

/// A lognormal service time: `median x exp(sigma x Z)`, Z standard normal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServiceTime {
    pub median: Duration,
    pub sigma: f64,
}

impl ServiceTime {
    pub fn sample(&self, rng: &mut fastrand::Rng) -> Duration {
        self.median
            .mul_f64((self.sigma * standard_normal(rng)).exp().min(1e6))
    }

    /// The distribution's mean, `median x exp(sigma^2 / 2)`.
    pub fn mean(&self) -> Duration {
        self.median.mul_f64((self.sigma * self.sigma / 2.0).exp())
    }
}

/// A standard normal draw (Box-Muller).
pub fn standard_normal(rng: &mut fastrand::Rng) -> f64 {
    // 1 - f64() is in (0, 1]: the logarithm is finite.
    let u1 = 1.0 - rng.f64();
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Simulated devices written wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimDevicesError {
    #[error("`{0}`: simulated devices are written sim:SPEED,SPEED,... (e.g. sim:1,1,1,0.5)")]
    NotSim(String),
    #[error("`{speed}` in `{text}`: a speed is a positive number")]
    Speed { speed: String, text: String },
}

/// `sim:1.0,1.0,0.5`: one simulated device per speed factor (1.0 = the reference).
pub fn parse_sim_devices(text: &str) -> Result<Vec<f64>, SimDevicesError> {
    let list = text
        .trim()
        .strip_prefix("sim:")
        .ok_or_else(|| SimDevicesError::NotSim(text.to_string()))?;
    list.split(',')
        .map(|s| match s.trim().parse::<f64>() {
            Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
            _ => Err(SimDevicesError::Speed {
                speed: s.to_string(),
                text: text.to_string(),
            }),
        })
        .collect()
}

/// Switches shared by a simulated device's replicas, for failure tests.
#[derive(Debug, Default)]
pub struct SimControl {
    /// While set, every run and health check fails.
    pub failing: AtomicBool,
    /// Runs executed (batches), over the device's replicas.
    pub runs: AtomicUsize,
}

/// How a simulated device behaves.
#[derive(Debug, Clone, Copy)]
pub struct SimProfile {
    /// The fixed part's distribution (its median is the models' time at speed 1).
    pub service: ServiceTime,
    /// The part that grows with the request's pixels, per megapixel at speed 1 (drawn
    /// with the same lognormal factor as the fixed part).
    pub per_megapixel: Duration,
    pub speed: f64,
    /// Extra time per additional request in a batch, as a share of one request's: a
    /// batch of n takes `t x (1 + batch_cost x (n - 1))`.
    pub batch_cost: f64,
}

/// One replica of a simulated device.
pub struct SimExecutor {
    profile: SimProfile,
    rng: fastrand::Rng,
    control: Arc<SimControl>,
}

impl SimExecutor {
    pub fn new(profile: SimProfile, seed: u64, control: Arc<SimControl>) -> Self {
        Self {
            profile,
            rng: fastrand::Rng::with_seed(seed),
            control,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("simulated device failure")]
pub struct SimFailure;

/// What a simulated run took, and its fixed part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimRun {
    pub took: Duration,
    pub fixed: Duration,
}

impl Executor for SimExecutor {
    type Input = Work;
    type Output = SimRun;

    fn run_batch(&mut self, inputs: &[&Work]) -> Result<Vec<SimRun>, ExecError> {
        self.control.runs.fetch_add(1, Ordering::Relaxed);
        if self.control.failing.load(Ordering::Acquire) {
            return Err(SimFailure.into());
        }
        let p = self.profile;
        let extra = p.batch_cost * inputs.len().saturating_sub(1) as f64;
        let fixed = p
            .service
            .sample(&mut self.rng)
            .div_f64(p.speed)
            .mul_f64(1.0 + extra);
        // The same draw scales both parts: a slow moment of the device is slow for all.
        let factor = fixed.as_secs_f64() / p.service.median.as_secs_f64().max(1e-12);
        let megapixels: f64 = inputs.iter().map(|w| w.pixels as f64 / 1e6).sum();
        let variable = p.per_megapixel.mul_f64(megapixels * factor / p.speed);
        let took = fixed + variable;
        std::thread::sleep(took);
        Ok(vec![SimRun { took, fixed }; inputs.len()])
    }

    fn parts(&self, output: &SimRun) -> Option<RunParts> {
        Some(RunParts {
            fixed: output.fixed,
            composite: Duration::ZERO,
        })
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        if self.control.failing.load(Ordering::Acquire) {
            return Err(SimFailure.into());
        }
        Ok(())
    }
}

/// Simulated devices `sim0`, `sim1`, ... with the given speeds, and their controls.
pub fn sim_devices(
    speeds: &[f64],
    service: ServiceTime,
    per_megapixel: Duration,
    replicas: usize,
    batching: BatchingSpec,
    batch_cost: f64,
    seed: u64,
) -> (Vec<DeviceSetup<SimExecutor>>, Vec<Arc<SimControl>>) {
    let mut setups = Vec::new();
    let mut controls = Vec::new();
    for (index, &speed) in speeds.iter().enumerate() {
        let control = Arc::new(SimControl::default());
        let profile = SimProfile {
            service,
            per_megapixel,
            speed,
            batch_cost,
        };
        let shared = control.clone();
        setups.push(DeviceSetup {
            name: format!("sim{index}"),
            replicas,
            batching,
            load: Arc::new(move |replica| {
                let seed = seed ^ ((index as u64) << 32) ^ replica as u64;
                Ok(SimExecutor::new(profile, seed, shared.clone()))
            }),
            interim: false,
        });
        controls.push(control);
    }
    (setups, controls)
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Open loop: exponential gaps at this mean rate, whatever the answers.
    Poisson { rate_per_s: f64 },
    /// Closed loop: this many clients, each sending its next request on an answer.
    Closed { concurrency: usize },
}

/// One size of request in the traffic: its work, its share, and the deadline it is sent
/// with (from its sending).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeClass {
    pub work: Work,
    pub weight: f64,
    pub deadline: Duration,
}

impl SizeClass {
    /// Requests of one size (no pixels: the fixed part alone) with `deadline`.
    pub fn uniform(deadline: Duration) -> Vec<SizeClass> {
        vec![SizeClass {
            work: Work::default(),
            weight: 1.0,
            deadline,
        }]
    }
}

#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub arrivals: Arrivals,
    pub requests: usize,
    /// The traffic's sizes, drawn by weight for each request.
    pub sizes: Vec<SizeClass>,
    pub seed: u64,
}

impl LoadSpec {
    /// The size class of each request, drawn by weight from the seed.
    fn draw_classes(&self) -> Vec<usize> {
        let total: f64 = self.sizes.iter().map(|c| c.weight.max(0.0)).sum();
        let mut rng = fastrand::Rng::with_seed(self.seed ^ 0x5153);
        (0..self.requests)
            .map(|_| {
                let mut x = rng.f64() * total;
                for (i, c) in self.sizes.iter().enumerate() {
                    x -= c.weight.max(0.0);
                    if x < 0.0 {
                        return i;
                    }
                }
                self.sizes.len().saturating_sub(1)
            })
            .collect()
    }
}

/// Order statistics of a set of durations.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Percentiles {
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Percentiles {
    pub fn of(mut values: Vec<Duration>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_unstable();
        let at = |q: f64| crate::stats::quantile(&values, q).unwrap_or_default();
        Self {
            p50: at(0.50),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

/// What one size class of a load run got.
#[derive(Debug, Clone, Default)]
pub struct ClassReport {
    pub work: Work,
    pub sent: usize,
    pub completed: usize,
    /// Completed requests, from their sending to their result.
    pub latency: Percentiles,
    /// Admitted and ended by their deadline (`JobError::DeadlineExceeded`), or answered
    /// after it.
    pub late: usize,
    /// Refused, at admission or by the queue, because they could not finish in time.
    pub refused_for_deadline: usize,
}

/// What one load run measured.
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub requests: usize,
    pub completed: usize,
    /// Refused at admission (`SubmitError::Overloaded`, `WaitTooLong`,
    /// `DeadlineUnreachable`).
    pub rejected: usize,
    /// Admitted but failed, or refused for another reason.
    pub failed: usize,
    /// Requests sent per second (measured between the first and last sending).
    pub offered_rps: f64,
    /// Results per second between the first sending and the last result.
    pub throughput_rps: f64,
    /// Completed requests, from their scheduled arrival to their result.
    pub latency: Percentiles,
    /// How long `submit` took to refuse.
    pub rejection: Percentiles,
    /// Mean cost of one `submit` call (admission, placement, enqueue and the wake-up of
    /// a sleeping replica), nanoseconds.
    pub submit_ns: f64,
    /// Mean cost of the placement decision alone (`Scheduler::choose` under the same live
    /// load, sampled every `DECISION_SAMPLE_EVERY` requests), nanoseconds.
    pub decision_ns: f64,
    /// By size class, in `LoadSpec::sizes`' order.
    pub classes: Vec<ClassReport>,
}

impl LoadReport {
    /// Late or refused for their deadline, over the requests sent.
    pub fn deadline_missed_share(&self) -> f64 {
        self.late_share() + self.share(|c| c.refused_for_deadline)
    }

    /// Admitted and then late (answered after their deadline, or ended by it), over the
    /// requests sent: the misses a refusal at once did not spare the client.
    pub fn late_share(&self) -> f64 {
        self.share(|c| c.late)
    }

    fn share(&self, count: impl Fn(&ClassReport) -> usize) -> f64 {
        let n: usize = self.classes.iter().map(count).sum();
        n as f64 / self.requests.max(1) as f64
    }
}

/// How often the load generator also times the router's decision, and how many
/// decisions it times at once (one clock pair for several calls).
const DECISION_SAMPLE_EVERY: usize = 32;
const DECISIONS_PER_SAMPLE: u32 = 16;

/// Every `DECISION_SAMPLE_EVERY`th request (the `i`th), the mean time of one placement
/// decision for `work` on `router` as it is now, into `decisions`.
fn sample_decision<E: Executor>(
    router: &Scheduler<E>,
    i: usize,
    work: Work,
    decisions: &std::sync::Mutex<Vec<Duration>>,
) {
    if !i.is_multiple_of(DECISION_SAMPLE_EVERY) {
        return;
    }
    let t = Instant::now();
    for _ in 0..DECISIONS_PER_SAMPLE {
        let _ = std::hint::black_box(router.choose(work));
    }
    let took = t.elapsed() / DECISIONS_PER_SAMPLE;
    if let Ok(mut d) = decisions.lock() {
        d.push(took);
    }
}

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Done,
    /// Ended by its deadline, or answered after it.
    Late,
    RefusedForDeadline,
    /// Refused at admission for overload.
    Rejected,
    Failed,
}

fn outcome_of_submit(e: &SubmitError) -> Outcome {
    match e {
        SubmitError::DeadlineUnreachable { .. } | SubmitError::AdmittedFirst { .. } => {
            Outcome::RefusedForDeadline
        }
        SubmitError::Overloaded { .. } | SubmitError::WaitTooLong { .. } => Outcome::Rejected,
        _ => Outcome::Failed,
    }
}

fn outcome_of_job(result: &Result<(), JobError>, late: bool) -> Outcome {
    match result {
        Ok(()) if late => Outcome::Late,
        Ok(()) => Outcome::Done,
        Err(JobError::DeadlineExceeded) => Outcome::Late,
        Err(JobError::DeadlineUnreachable) => Outcome::RefusedForDeadline,
        Err(JobError::Rejected(e)) => outcome_of_submit(e),
        Err(_) => Outcome::Failed,
    }
}

struct Sample {
    class: usize,
    outcome: Outcome,
    arrived: Instant,
    finished: Instant,
    submit: Duration,
}

/// A request sent: its ticket and deadline, or how it was refused at once.
struct Sent<E: Executor> {
    class: usize,
    arrived: Instant,
    submit: Duration,
    admitted: Result<(super::Ticket<E>, Instant), Outcome>,
}

/// Admits and places one request of `class` now (no await: admission answers at once).
fn send<E>(router: &Scheduler<E>, load: &LoadSpec, class: usize, arrived: Instant) -> Sent<E>
where
    E: Executor<Input = Work>,
{
    let size = load.sizes[class];
    let sent = Instant::now();
    let deadline = sent + size.deadline;
    // A client's deadline on a server whose own is a minute (serve's default).
    let terms = Terms::by(deadline)
        .with_server_deadline(sent + Duration::from_secs(60))
        .with_work(size.work);
    let result = router
        .admit()
        .and_then(|a| router.submit_admitted(a, size.work, terms));
    Sent {
        class,
        arrived,
        submit: sent.elapsed(),
        admitted: result
            .map(|t| (t, deadline))
            .map_err(|e| outcome_of_submit(&e)),
    }
}

/// Waits for a sent request's answer.
async fn answered<E: Executor>(sent: Sent<E>) -> Sample {
    let outcome = match sent.admitted {
        Ok((ticket, deadline)) => {
            let answer = ticket.wait().await.map(drop);
            outcome_of_job(&answer, Instant::now() > deadline)
        }
        Err(outcome) => outcome,
    };
    Sample {
        class: sent.class,
        outcome,
        arrived: sent.arrived,
        finished: Instant::now(),
        submit: sent.submit,
    }
}

/// Runs `load` against `router`; answers are awaited on `runtime`. Blocks until every
/// admitted request has its answer.
pub fn drive<E>(
    router: &Arc<Scheduler<E>>,
    runtime: &tokio::runtime::Runtime,
    load: &LoadSpec,
) -> LoadReport
where
    E: Executor<Input = Work>,
{
    let classes = Arc::new(load.draw_classes());
    let load = Arc::new(load.clone());
    let (tx, rx) = std::sync::mpsc::channel::<Sample>();
    let mut first_sent = None;
    let mut last_sent = Instant::now();
    let decisions = Arc::new(std::sync::Mutex::new(Vec::new()));
    match load.arrivals {
        Arrivals::Poisson { rate_per_s } => {
            let mut rng = fastrand::Rng::with_seed(load.seed);
            let start = Instant::now() + Duration::from_millis(5);
            let mut t = 0.0;
            for (i, &class) in classes.iter().enumerate() {
                sample_decision(router, i, load.sizes[class].work, &decisions);
                t += -(1.0 - rng.f64()).ln() / rate_per_s;
                let at = start + Duration::from_secs_f64(t);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                let sent = Instant::now();
                first_sent.get_or_insert(sent);
                last_sent = sent;
                // Admission and placement run here, at the arrival; only the wait for
                // the answer is spawned.
                let request = send(router, &load, class, at);
                let tx = tx.clone();
                runtime.spawn(async move {
                    let _ = tx.send(answered(request).await);
                });
            }
        }
        Arrivals::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            let started = Instant::now();
            first_sent = Some(started);
            let clients: Vec<_> = (0..concurrency.max(1))
                .map(|_| {
                    let (router, next, tx, load, classes, decisions) = (
                        router.clone(),
                        next.clone(),
                        tx.clone(),
                        load.clone(),
                        classes.clone(),
                        decisions.clone(),
                    );
                    runtime.spawn(async move {
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= load.requests {
                                break;
                            }
                            sample_decision(&router, i, load.sizes[classes[i]].work, &decisions);
                            let request = send(&router, &load, classes[i], Instant::now());
                            let sample = answered(request).await;
                            let refused =
                                sample.outcome != Outcome::Done && sample.outcome != Outcome::Late;
                            let _ = tx.send(sample);
                            if refused {
                                tokio::task::yield_now().await;
                            }
                        }
                    })
                })
                .collect();
            for client in clients {
                let _ = runtime.block_on(client);
            }
            last_sent = Instant::now();
        }
    }
    drop(tx);
    let samples: Vec<Sample> = rx.iter().collect();
    summarise(
        &load,
        &samples,
        first_sent.unwrap_or(last_sent),
        last_sent,
        &decisions,
    )
}

fn summarise(
    load: &LoadSpec,
    samples: &[Sample],
    first: Instant,
    last_sent: Instant,
    decisions: &std::sync::Mutex<Vec<Duration>>,
) -> LoadReport {
    let count = |of: &[&Sample], o: Outcome| of.iter().filter(|s| s.outcome == o).count();
    let all: Vec<&Sample> = samples.iter().collect();
    let answered = |s: &&Sample| matches!(s.outcome, Outcome::Done | Outcome::Late);
    let rejected: Vec<Duration> = samples
        .iter()
        .filter(|s| matches!(s.outcome, Outcome::Rejected | Outcome::RefusedForDeadline))
        .filter(|s| {
            s.finished.saturating_duration_since(s.arrived) <= s.submit + Duration::from_millis(50)
        })
        .map(|s| s.submit)
        .collect();
    let refused_at_once = samples
        .iter()
        .filter(|s| matches!(s.outcome, Outcome::Rejected | Outcome::RefusedForDeadline))
        .count();
    let completed: Vec<&Sample> = samples.iter().filter(answered).collect();
    let last_done = samples
        .iter()
        .map(|s| s.finished)
        .max()
        .unwrap_or(last_sent);
    let offered_span = last_sent.saturating_duration_since(first).as_secs_f64();
    let done_span = last_done.saturating_duration_since(first).as_secs_f64();
    let submits = samples.len().max(1);
    let latency = |of: &[&Sample]| {
        Percentiles::of(
            of.iter()
                .map(|s| s.finished.saturating_duration_since(s.arrived))
                .collect(),
        )
    };
    let classes = load
        .sizes
        .iter()
        .enumerate()
        .map(|(c, size)| {
            let of: Vec<&Sample> = samples.iter().filter(|s| s.class == c).collect();
            let done: Vec<&Sample> = of.iter().copied().filter(answered).collect();
            ClassReport {
                work: size.work,
                sent: of.len(),
                completed: done.len(),
                latency: latency(&done),
                late: count(&of, Outcome::Late),
                refused_for_deadline: count(&of, Outcome::RefusedForDeadline),
            }
        })
        .collect();
    LoadReport {
        requests: load.requests,
        completed: completed.len(),
        rejected: refused_at_once,
        failed: count(&all, Outcome::Failed),
        offered_rps: if offered_span > 0.0 {
            load.requests as f64 / offered_span
        } else {
            0.0
        },
        throughput_rps: if done_span > 0.0 {
            completed.len() as f64 / done_span
        } else {
            0.0
        },
        latency: latency(&completed),
        rejection: Percentiles::of(rejected),
        submit_ns: samples
            .iter()
            .map(|s| s.submit)
            .sum::<Duration>()
            .as_nanos() as f64
            / submits as f64,
        decision_ns: decisions
            .lock()
            .map(|d| d.iter().sum::<Duration>().as_nanos() as f64 / d.len().max(1) as f64)
            .unwrap_or(0.0),
        classes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lognormal_has_the_median_and_spread_asked() {
        let service = ServiceTime {
            median: Duration::from_millis(2),
            sigma: 0.25,
        };
        let mut rng = fastrand::Rng::with_seed(7);
        let draws: Vec<Duration> = (0..20_000).map(|_| service.sample(&mut rng)).collect();
        let p = Percentiles::of(draws.clone());
        let median_ms = p.p50.as_secs_f64() * 1e3;
        assert!((median_ms - 2.0).abs() < 0.05, "median {median_ms} ms");
        // p99 of a lognormal: median x exp(2.326 sigma) = 3.58 ms.
        let p99_ms = p.p99.as_secs_f64() * 1e3;
        assert!((p99_ms - 3.58).abs() < 0.15, "p99 {p99_ms} ms");
        let mean = draws.iter().sum::<Duration>().as_secs_f64() / draws.len() as f64;
        assert!((mean / service.mean().as_secs_f64() - 1.0).abs() < 0.02);
    }

    #[test]
    fn sim_devices_parse() {
        assert_eq!(parse_sim_devices("sim:1,1,0.5"), Ok(vec![1.0, 1.0, 0.5]));
        assert!(parse_sim_devices("1,1").is_err());
        assert!(parse_sim_devices("sim:1,0").is_err());
        assert!(parse_sim_devices("sim:fast").is_err());
    }

    #[test]
    fn percentiles_pick_order_statistics() {
        let values: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let p = Percentiles::of(values);
        assert_eq!(p.p50, Duration::from_millis(51));
        assert_eq!(p.p99, Duration::from_millis(100));
        assert_eq!(p.max, Duration::from_millis(100));
    }
}
