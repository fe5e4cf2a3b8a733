//! Simulated devices, for tests and capacity planning (`celer sim`) only; `serve` never
//! builds them. A simulated replica sleeps for a service time drawn from a lognormal
//! distribution divided by its device's speed, on a real replica thread behind the real
//! router, queues and batcher: what the load generator measures is the scheduler. Time is
//! wall time, so keep service times small (a median of a few milliseconds).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::scheduler::{DeviceSetup, Scheduler};
use super::{ExecError, Executor, SubmitError};
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
    pub service: ServiceTime,
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

impl Executor for SimExecutor {
    type Input = ();
    /// The service time the run was given.
    type Output = Duration;

    fn run_batch(&mut self, inputs: &[&()]) -> Result<Vec<Duration>, ExecError> {
        self.control.runs.fetch_add(1, Ordering::Relaxed);
        if self.control.failing.load(Ordering::Acquire) {
            return Err(SimFailure.into());
        }
        let p = self.profile;
        let extra = p.batch_cost * inputs.len().saturating_sub(1) as f64;
        let t = p
            .service
            .sample(&mut self.rng)
            .div_f64(p.speed)
            .mul_f64(1.0 + extra);
        std::thread::sleep(t);
        Ok(vec![t; inputs.len()])
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

#[derive(Debug, Clone, Copy)]
pub struct LoadSpec {
    pub arrivals: Arrivals,
    pub requests: usize,
    pub deadline: Duration,
    pub seed: u64,
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

/// What one load run measured.
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub requests: usize,
    pub completed: usize,
    /// Refused at admission (`SubmitError::Overloaded`).
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
}

/// How often the load generator also times the router's decision, and how many
/// decisions it times at once (one clock pair for several calls).
const DECISION_SAMPLE_EVERY: usize = 32;
const DECISIONS_PER_SAMPLE: u32 = 16;

/// Mean time of one placement decision on `router` as it is now.
fn time_decisions<E: Executor>(router: &Scheduler<E>) -> Duration {
    let t = Instant::now();
    for _ in 0..DECISIONS_PER_SAMPLE {
        let _ = std::hint::black_box(router.choose());
    }
    t.elapsed() / DECISIONS_PER_SAMPLE
}

struct Sample {
    ok: bool,
    arrived: Instant,
    finished: Instant,
    submit: Duration,
}

/// Runs `load` against `router`; answers are awaited on `runtime`. Blocks until every
/// admitted request has its answer.
pub fn drive<E>(
    router: &Arc<Scheduler<E>>,
    runtime: &tokio::runtime::Runtime,
    load: &LoadSpec,
) -> LoadReport
where
    E: Executor<Input = ()>,
{
    let (tx, rx) = std::sync::mpsc::channel::<Sample>();
    let mut rejections = Vec::new();
    let mut failed = 0;
    let mut first_sent = None;
    let mut last_sent = Instant::now();
    let mut submit_total = Duration::ZERO;
    let decisions = Arc::new(std::sync::Mutex::new(Vec::new()));
    match load.arrivals {
        Arrivals::Poisson { rate_per_s } => {
            let mut rng = fastrand::Rng::with_seed(load.seed);
            let start = Instant::now() + Duration::from_millis(5);
            let mut t = 0.0;
            for i in 0..load.requests {
                if i % DECISION_SAMPLE_EVERY == 0 {
                    if let Ok(mut d) = decisions.lock() {
                        d.push(time_decisions(router));
                    }
                }
                t += -(1.0 - rng.f64()).ln() / rate_per_s;
                let at = start + Duration::from_secs_f64(t);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                let sent = Instant::now();
                first_sent.get_or_insert(sent);
                last_sent = sent;
                let result = router.submit((), sent + load.deadline);
                let submit = sent.elapsed();
                submit_total += submit;
                match result {
                    Ok(ticket) => {
                        let tx = tx.clone();
                        runtime.spawn(async move {
                            let ok = ticket.wait().await.is_ok();
                            let _ = tx.send(Sample {
                                ok,
                                arrived: at,
                                finished: Instant::now(),
                                submit,
                            });
                        });
                    }
                    Err(SubmitError::Overloaded { .. } | SubmitError::WaitTooLong { .. }) => {
                        rejections.push(submit)
                    }
                    Err(_) => failed += 1,
                }
            }
        }
        Arrivals::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            let refused = Arc::new(std::sync::Mutex::new(Vec::new()));
            let started = Instant::now();
            first_sent = Some(started);
            let clients: Vec<_> = (0..concurrency.max(1))
                .map(|_| {
                    let (router, next, tx, refused, decisions) = (
                        router.clone(),
                        next.clone(),
                        tx.clone(),
                        refused.clone(),
                        decisions.clone(),
                    );
                    let requests = load.requests;
                    let deadline = load.deadline;
                    runtime.spawn(async move {
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= requests {
                                break;
                            }
                            if i % DECISION_SAMPLE_EVERY == 0 {
                                let took = time_decisions(&router);
                                if let Ok(mut d) = decisions.lock() {
                                    d.push(took);
                                }
                            }
                            let sent = Instant::now();
                            let result = router.submit((), sent + deadline);
                            let submit = sent.elapsed();
                            match result {
                                Ok(ticket) => {
                                    let ok = ticket.wait().await.is_ok();
                                    let _ = tx.send(Sample {
                                        ok,
                                        arrived: sent,
                                        finished: Instant::now(),
                                        submit,
                                    });
                                }
                                Err(_) => {
                                    if let Ok(mut r) = refused.lock() {
                                        r.push(submit);
                                    }
                                    tokio::task::yield_now().await;
                                }
                            }
                        }
                    })
                })
                .collect();
            for client in clients {
                let _ = runtime.block_on(client);
            }
            last_sent = Instant::now();
            rejections = refused.lock().map(|r| r.clone()).unwrap_or_default();
        }
    }
    drop(tx);
    let samples: Vec<Sample> = rx.iter().collect();
    let first = first_sent.unwrap_or(last_sent);
    let completed: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let last_done = samples
        .iter()
        .map(|s| s.finished)
        .max()
        .unwrap_or(last_sent);
    let offered_span = last_sent.saturating_duration_since(first).as_secs_f64();
    let done_span = last_done.saturating_duration_since(first).as_secs_f64();
    if matches!(load.arrivals, Arrivals::Closed { .. }) {
        submit_total = samples.iter().map(|s| s.submit).sum::<Duration>()
            + rejections.iter().sum::<Duration>();
    }
    let submits = (samples.len() + rejections.len() + failed).max(1);
    LoadReport {
        requests: load.requests,
        completed: completed.len(),
        rejected: rejections.len(),
        failed: failed + samples.len() - completed.len(),
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
        latency: Percentiles::of(
            completed
                .iter()
                .map(|s| s.finished.saturating_duration_since(s.arrived))
                .collect(),
        ),
        rejection: Percentiles::of(rejections),
        submit_ns: submit_total.as_nanos() as f64 / submits as f64,
        decision_ns: decisions
            .lock()
            .map(|d| d.iter().sum::<Duration>().as_nanos() as f64 / d.len().max(1) as f64)
            .unwrap_or(0.0),
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
