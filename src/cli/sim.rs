//! `celer sim`: capacity planning with simulated devices. Each point starts a real router
//! (queues, replica threads, channels) over `sim:` devices whose service times are drawn
//! from a lognormal distribution, drives it with Poisson or closed-loop load in wall time,
//! and prints the measured table, with the medians over repeats checked against targets.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::sched::sim::{
    drive, parse_sim_devices, sim_devices, Arrivals, LoadReport, LoadSpec, ServiceTime,
    SimDevicesError, SizeClass,
};
use crate::sched::{Routing, Scheduler, SchedulerConfig, Scheduling, Work};
use crate::spec::BatchingSpec;

#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Devices of the placement check, by speed factor.
    #[arg(long, default_value = "sim:1,1,1,0.5", value_parser = speeds)]
    pub devices: Speeds,

    /// Median service time of a speed-1 device, milliseconds (wall time: keep it small).
    #[arg(long, default_value_t = 2.0)]
    pub median_ms: f64,

    /// Lognormal sigma of the service time.
    #[arg(long, default_value_t = 0.25)]
    pub sigma: f64,

    /// Replicas per simulated device.
    #[arg(long, default_value_t = 1, value_parser = super::args::at_least_one())]
    pub replicas: usize,

    /// Requests per point.
    #[arg(long, default_value_t = 20_000, value_parser = super::args::at_least_one())]
    pub requests: usize,

    /// Runs of every point; the summary gives their medians.
    #[arg(long, default_value_t = 3, value_parser = super::args::at_least_one())]
    pub repeats: usize,

    /// Offered load of the placement check, as a share of total capacity.
    #[arg(long, default_value_t = 0.8)]
    pub load: f64,

    /// Offered load of the overload check, as a share of total capacity.
    #[arg(long, default_value_t = 1.5)]
    pub overload: f64,

    /// Queue capacity per device in the placement check: large, so that the baselines'
    /// queues show their latency rather than refusals.
    #[arg(long, default_value_t = 64, value_parser = super::args::at_least_one())]
    pub placement_queue: usize,

    /// Queue capacity per device in the overload check: what bounds admitted latency.
    #[arg(long, default_value_t = 1, value_parser = super::args::at_least_one())]
    pub overload_queue: usize,

    /// Which checks to run.
    #[arg(long, value_enum, default_value_t = Check::All)]
    pub check: Check,

    /// Seed of the arrivals and service times (each point and repeat derives its own).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// The mixed check's traffic: image sizes and their shares (`WxH:share,...`).
    #[arg(long, default_value = "320x320:1,4032x3024:1", value_parser = parse_mix)]
    pub mix: Mix,

    /// The mixed check's fixed part of a request (its models) at speed 1, milliseconds.
    #[arg(long, default_value_t = 0.5)]
    pub fixed_ms: f64,

    /// The mixed check's part that grows with the pixels, milliseconds per megapixel at
    /// speed 1. With the fixed part's default, a 4032x3024 photo costs 20x a 320x320
    /// one, as on a CPU.
    #[arg(long, default_value_t = 0.93)]
    pub ms_per_megapixel: f64,

    /// Requests per point of the mixed check.
    #[arg(long, default_value_t = 6000, value_parser = super::args::at_least_one())]
    pub mixed_requests: usize,

    /// The mixed check's deadlines: this many times each size's service time at speed 1.
    #[arg(long, default_value_t = 10.0)]
    pub deadline_factor: f64,
}

/// Image sizes and their shares of the traffic.
#[derive(Debug, Clone)]
pub struct Mix(Vec<(u32, u32, f64)>);

fn parse_mix(text: &str) -> Result<Mix, String> {
    let wrong = || format!("`{text}`: expected WxH:share,... (e.g. 320x320:1,4032x3024:1)");
    text.split(',')
        .map(|part| {
            let (size, share) = part.trim().split_once(':').ok_or_else(wrong)?;
            let (w, h) = size.split_once('x').ok_or_else(wrong)?;
            let share: f64 = share.parse().map_err(|_| wrong())?;
            match (w.parse::<u32>(), h.parse::<u32>()) {
                (Ok(w), Ok(h)) if w > 0 && h > 0 && share > 0.0 && share.is_finite() => {
                    Ok((w, h, share))
                }
                _ => Err(wrong()),
            }
        })
        .collect::<Result<_, _>>()
        .map(Mix)
}

/// Speed factors of simulated devices (one value for clap, not a list of arguments).
#[derive(Debug, Clone)]
pub struct Speeds(Vec<f64>);

fn speeds(text: &str) -> Result<Speeds, SimDevicesError> {
    parse_sim_devices(text).map(Speeds)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Check {
    All,
    Placement,
    Scaling,
    Overload,
    /// Mixed sizes: cost-aware routing and order against the count-based estimate, one
    /// copy per device behind least-outstanding-requests, and random.
    Mixed,
}

/// What the requests of a point cost: the fixed part's distribution, the part per
/// megapixel, and the sizes sent.
#[derive(Clone)]
struct Traffic {
    service: ServiceTime,
    per_megapixel: Duration,
    sizes: Vec<SizeClass>,
}

struct Point<'a> {
    speeds: &'a [f64],
    queue: usize,
    routing: Routing,
    scheduling: Scheduling,
    arrivals: Arrivals,
    traffic: &'a Traffic,
    requests: usize,
}

struct Sim {
    args: SimArgs,
    runtime: tokio::runtime::Runtime,
}

impl Sim {
    fn run(&self, point: &Point, seed: u64) -> anyhow::Result<LoadReport> {
        let (setups, _) = sim_devices(
            point.speeds,
            point.traffic.service,
            point.traffic.per_megapixel,
            self.args.replicas,
            BatchingSpec::OFF,
            0.0,
            seed,
        );
        let router = Arc::new(Scheduler::start(
            setups,
            SchedulerConfig {
                routing: point.routing,
                scheduling: point.scheduling,
                queue_capacity: point.queue,
                ..SchedulerConfig::default()
            },
        ));
        router.wait_ready().map_err(anyhow::Error::msg)?;
        let report = drive(
            &router,
            &self.runtime,
            &LoadSpec {
                arrivals: point.arrivals,
                requests: point.requests,
                sizes: point.traffic.sizes.clone(),
                seed,
            },
        );
        router.shutdown();
        Ok(report)
    }
}

/// One measured row per repeat, reduced to medians.
struct Rows {
    label: String,
    reports: Vec<LoadReport>,
}

impl Rows {
    fn median(&self, f: impl Fn(&LoadReport) -> f64) -> f64 {
        let mut v: Vec<f64> = self.reports.iter().map(f).collect();
        crate::stats::median(&mut v)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn print_header() {
    println!(
        "| {:<34} | {:>9} | {:>9} | {:>8} | {:>8} | {:>8} | {:>9} | {:>10} | {:>9} | {:>9} |",
        "point",
        "offered/s",
        "done/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "rejected",
        "rej p99 us",
        "submit ns",
        "decide ns"
    );
    println!(
        "|{:-<36}|{:->11}|{:->11}|{:->10}|{:->10}|{:->10}|{:->11}|{:->12}|{:->11}|{:->11}|",
        "", "", "", "", "", "", "", "", "", ""
    );
}

fn print_row(rows: &Rows) {
    println!(
        "| {:<34} | {:>9.0} | {:>9.0} | {:>8.2} | {:>8.2} | {:>8.2} | {:>9.0} | {:>10.1} | {:>9.0} | {:>9.0} |",
        rows.label,
        rows.median(|r| r.offered_rps),
        rows.median(|r| r.throughput_rps),
        rows.median(|r| ms(r.latency.p50)),
        rows.median(|r| ms(r.latency.p99)),
        rows.median(|r| ms(r.latency.max)),
        rows.median(|r| r.rejected as f64),
        rows.median(|r| r.rejection.p99.as_secs_f64() * 1e6),
        rows.median(|r| r.submit_ns),
        rows.median(|r| r.decision_ns),
    );
}

pub fn sim(args: SimArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let service = ServiceTime {
        median: Duration::from_secs_f64(args.median_ms.max(0.01) / 1e3),
        sigma: args.sigma.max(0.0),
    };
    // The placement, scaling and overload checks: requests of one size.
    let uniform = Traffic {
        service,
        per_megapixel: Duration::ZERO,
        sizes: SizeClass::uniform(Duration::from_secs(60)),
    };
    let sim = Sim {
        args: args.clone(),
        runtime,
    };
    let repeats = args.repeats;
    println!(
        "celer sim: lognormal service time, median {} ms, sigma {}, {} replica(s) per device, {} requests per point, median of {repeats} run(s); wall time, real router threads and queues",
        args.median_ms, args.sigma, args.replicas, args.requests
    );

    // One device at saturation: the unit of capacity every other point is sized from.
    let one = [1.0];
    let reference = Point {
        speeds: &one,
        queue: 16,
        routing: Routing::LeastBusy,
        scheduling: Scheduling::Cost,
        arrivals: Arrivals::Closed {
            concurrency: 4 * args.replicas,
        },
        traffic: &uniform,
        requests: args.requests,
    };
    let mut unit = Rows {
        label: "1 device, saturated (closed loop)".into(),
        reports: Vec::new(),
    };
    // The mixed check sizes its load from its own prices, not from this.
    let uniform_checks = args.check != Check::Mixed;
    if uniform_checks {
        for r in 0..repeats {
            unit.reports
                .push(sim.run(&reference, args.seed + r as u64)?);
        }
        print_header();
        print_row(&unit);
    }
    let unit_rps = unit.median(|r| r.throughput_rps);
    let mut verdicts = Vec::new();

    if matches!(args.check, Check::All | Check::Placement) {
        let capacity: f64 = args.devices.0.iter().sum::<f64>() * unit_rps;
        let rate = args.load * capacity;
        let mut p99 = Vec::new();
        let mut least_busy_throughput = 0.0;
        for routing in [Routing::LeastBusy, Routing::RoundRobin, Routing::Random] {
            let point = Point {
                speeds: &args.devices.0,
                queue: args.placement_queue,
                routing,
                scheduling: baseline_unless_least_busy(routing),
                arrivals: Arrivals::Poisson { rate_per_s: rate },
                traffic: &uniform,
                requests: args.requests,
            };
            let mut rows = Rows {
                label: format!(
                    "{} devs {:.0}% load, {routing}",
                    args.devices.0.len(),
                    args.load * 100.0
                ),
                reports: Vec::new(),
            };
            for r in 0..repeats {
                rows.reports
                    .push(sim.run(&point, args.seed + 100 + r as u64)?);
            }
            print_row(&rows);
            p99.push(rows.median(|r| ms(r.latency.p99)));
            if routing == Routing::LeastBusy {
                least_busy_throughput = rows.median(|r| r.throughput_rps / r.offered_rps.max(1e-9));
            }
        }
        verdicts.push(format!(
            "placement: least-busy p99 / round-robin p99 = {:.3} (target <= 0.5), / random p99 = {:.3} (target <= 0.5); least-busy throughput / offered = {:.3} (target >= 0.97)",
            p99[0] / p99[1],
            p99[0] / p99[2],
            least_busy_throughput
        ));
    }

    if matches!(args.check, Check::All | Check::Scaling) {
        let eight = [1.0; 8];
        let point = Point {
            speeds: &eight,
            queue: 16,
            routing: Routing::LeastBusy,
            scheduling: Scheduling::Cost,
            arrivals: Arrivals::Closed {
                concurrency: 8 * 4 * args.replicas,
            },
            traffic: &uniform,
            requests: args.requests,
        };
        let mut rows = Rows {
            label: "8 devices, saturated (closed loop)".into(),
            reports: Vec::new(),
        };
        for r in 0..repeats {
            rows.reports
                .push(sim.run(&point, args.seed + 200 + r as u64)?);
        }
        print_row(&rows);
        verdicts.push(format!(
            "scaling: 8-device throughput / (8 x one device) = {:.3} (target >= 0.95); router decision {:.0} ns per request (target < 2000), whole submit {:.0} ns",
            rows.median(|r| r.throughput_rps) / (8.0 * unit_rps),
            rows.median(|r| r.decision_ns),
            rows.median(|r| r.submit_ns)
        ));
    }

    if matches!(args.check, Check::All | Check::Overload) {
        let four = [1.0; 4];
        // Unloaded: one client per device, so every request finds an idle device.
        let unloaded = Point {
            speeds: &four,
            queue: args.overload_queue,
            routing: Routing::LeastBusy,
            scheduling: Scheduling::Cost,
            arrivals: Arrivals::Closed {
                concurrency: 4 * args.replicas,
            },
            traffic: &uniform,
            requests: args.requests,
        };
        let overloaded = Point {
            arrivals: Arrivals::Poisson {
                rate_per_s: args.overload * 4.0 * unit_rps,
            },
            ..unloaded
        };
        let mut quiet = Rows {
            label: "4 devices, unloaded".into(),
            reports: Vec::new(),
        };
        let mut loud = Rows {
            label: format!("4 devices, {:.0}% load", args.overload * 100.0),
            reports: Vec::new(),
        };
        for r in 0..repeats {
            quiet
                .reports
                .push(sim.run(&unloaded, args.seed + 300 + r as u64)?);
            loud.reports
                .push(sim.run(&overloaded, args.seed + 400 + r as u64)?);
        }
        print_row(&quiet);
        print_row(&loud);
        verdicts.push(format!(
            "overload: admitted p99 / unloaded p99 = {:.3} (target <= 2); {:.1}% refused with 503, refusal p99 {:.1} us, max {:.1} us (target < 1000 us)",
            loud.median(|r| ms(r.latency.p99)) / quiet.median(|r| ms(r.latency.p99)),
            loud.median(|r| r.rejected as f64 / r.requests as f64) * 100.0,
            loud.median(|r| r.rejection.p99.as_secs_f64() * 1e6),
            loud.median(|r| r.rejection.max.as_secs_f64() * 1e6),
        ));
    }
    if matches!(args.check, Check::All | Check::Mixed) {
        verdicts.extend(mixed(&sim, &args)?);
    }
    println!();
    for v in verdicts {
        println!("{v}");
    }
    Ok(())
}

/// The routing and queue order of a placement baseline: what other routers do (by
/// count, in arrival order); celer's least-busy by cost.
fn baseline_unless_least_busy(routing: Routing) -> Scheduling {
    match routing {
        Routing::LeastBusy => Scheduling::Cost,
        _ => Scheduling::Count,
    }
}

/// The policies the mixed check compares: celer's, and the alternatives users have.
const POLICIES: [(&str, Routing, Scheduling); 4] = [
    ("cost-aware (celer)", Routing::LeastBusy, Scheduling::Cost),
    (
        "count-based earliest completion",
        Routing::LeastBusy,
        Scheduling::Count,
    ),
    (
        "copy per device, least outstanding",
        Routing::LeastOutstanding,
        Scheduling::Count,
    ),
    ("random", Routing::Random, Scheduling::Count),
];

/// A point of the mixed check: the placement devices under `policy`, Poisson arrivals
/// at `rate_per_s`.
fn mixed_point<'a>(
    args: &'a SimArgs,
    (routing, scheduling): (Routing, Scheduling),
    rate_per_s: f64,
    traffic: &'a Traffic,
) -> Point<'a> {
    Point {
        speeds: &args.devices.0,
        queue: args.placement_queue,
        routing,
        scheduling,
        arrivals: Arrivals::Poisson { rate_per_s },
        traffic,
        requests: args.mixed_requests,
    }
}

/// Mixed sizes over the placement devices: p50 and p99 by size class at `--load` (long
/// deadlines: every request answered), then the share of deadlines missed (late, or
/// refused because they could not be met) at 50, 70 and 90 % load with deadlines of
/// `--deadline-factor` times each size's service time.
fn mixed(sim: &Sim, args: &SimArgs) -> anyhow::Result<Vec<String>> {
    let fixed_s = args.fixed_ms.max(0.01) / 1e3;
    let per_mp_s = args.ms_per_megapixel.max(0.0) / 1e3;
    let service_of = |w: u32, h: u32| fixed_s + per_mp_s * f64::from(w) * f64::from(h) / 1e6;
    let classes = |deadline: &dyn Fn(f64) -> Duration| -> Vec<SizeClass> {
        args.mix
            .0
            .iter()
            .map(|&(w, h, share)| SizeClass {
                work: Work::of_image(w, h, false),
                weight: share,
                deadline: deadline(service_of(w, h)),
            })
            .collect()
    };
    let service = ServiceTime {
        median: Duration::from_secs_f64(fixed_s),
        sigma: args.sigma.max(0.0),
    };
    let patient = Traffic {
        service,
        per_megapixel: Duration::from_secs_f64(per_mp_s),
        sizes: classes(&|_| Duration::from_secs(60)),
    };
    let total_share: f64 = args.mix.0.iter().map(|c| c.2).sum();
    let mean_s = args
        .mix
        .0
        .iter()
        .map(|&(w, h, share)| share * service_of(w, h))
        .sum::<f64>()
        / total_share
        * service.mean().as_secs_f64()
        / service.median.as_secs_f64();
    let capacity = args.devices.0.iter().sum::<f64>() * args.replicas as f64 / mean_s;
    let names: Vec<String> = args
        .mix
        .0
        .iter()
        .map(|(w, h, _)| format!("{w}x{h}"))
        .collect();
    println!();
    println!(
        "mixed sizes ({}), fixed {} ms + {} ms/MP at speed 1, over {} devices (speeds {:?}); capacity {:.0}/s; {} requests per point, median of {} run(s)",
        args.mix.0.iter().map(|(w, h, s)| format!("{w}x{h}:{s}")).collect::<Vec<_>>().join(","),
        args.fixed_ms,
        args.ms_per_megapixel,
        args.devices.0.len(),
        args.devices.0,
        capacity,
        args.mixed_requests,
        args.repeats
    );
    println!(
        "| {:<36} | {:>9} | {:>8} | {:>8} | {}",
        "policy, all sizes",
        "done/s",
        "p50 ms",
        "p99 ms",
        names
            .iter()
            .map(|n| format!("{n} p50 / p99 ms"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let mut p99 = Vec::new();
    let mut class_p99 = Vec::new();
    for (label, routing, scheduling) in POLICIES {
        let point = mixed_point(args, (routing, scheduling), args.load * capacity, &patient);
        let mut rows = Rows {
            label: label.to_string(),
            reports: Vec::new(),
        };
        for r in 0..args.repeats {
            rows.reports
                .push(sim.run(&point, args.seed + 500 + r as u64)?);
        }
        let by_class: Vec<(f64, f64)> = (0..names.len())
            .map(|c| {
                (
                    rows.median(|r| ms(r.classes[c].latency.p50)),
                    rows.median(|r| ms(r.classes[c].latency.p99)),
                )
            })
            .collect();
        println!(
            "| {:<36} | {:>9.0} | {:>8.2} | {:>8.2} | {}",
            label,
            rows.median(|r| r.throughput_rps),
            rows.median(|r| ms(r.latency.p50)),
            rows.median(|r| ms(r.latency.p99)),
            by_class
                .iter()
                .map(|(a, b)| format!("{a:.2} / {b:.2}"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        p99.push(rows.median(|r| ms(r.latency.p99)));
        class_p99.push(by_class.iter().map(|c| c.1).collect::<Vec<f64>>());
    }

    println!();
    println!(
        "deadlines of {}x each size's service time: share of requests late or refused for their deadline, and in brackets the share admitted and then late (one run a point)",
        args.deadline_factor
    );
    let loads = [0.5, 0.7, 0.9];
    println!(
        "| {:<36} | {} |",
        "policy",
        loads
            .iter()
            .map(|l| format!("{:>11.0}% load", l * 100.0))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let tight = Traffic {
        sizes: classes(&|s| Duration::from_secs_f64(s * args.deadline_factor)),
        ..patient.clone()
    };
    for (label, routing, scheduling) in POLICIES {
        let mut cells = Vec::new();
        for (k, load) in loads.iter().enumerate() {
            let point = mixed_point(args, (routing, scheduling), load * capacity, &tight);
            let report = sim.run(&point, args.seed + 600 + k as u64)?;
            cells.push(format!(
                "{:>6.2}% ({:>5.2}%)",
                report.deadline_missed_share() * 100.0,
                report.late_share() * 100.0
            ));
        }
        println!("| {:<36} | {} |", label, cells.join(" | "));
    }
    let per_class = |other: usize| {
        names
            .iter()
            .enumerate()
            .map(|(c, n)| format!("{n} {:.3}", class_p99[0][c] / class_p99[other][c]))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Ok(vec![format!(
        "mixed: cost-aware p99 / copy-per-device least-outstanding p99 = {:.3} (target <= 0.7; by size: {}), / count-based = {:.3} (by size: {}), / random = {:.3}",
        p99[0] / p99[2],
        per_class(2),
        p99[0] / p99[1],
        per_class(1),
        p99[0] / p99[3],
    )])
}
