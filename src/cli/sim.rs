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
use crate::sched::{Routing, Scheduler, SchedulerConfig};
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
}

struct Point<'a> {
    speeds: &'a [f64],
    queue: usize,
    routing: Routing,
    arrivals: Arrivals,
}

struct Sim {
    args: SimArgs,
    service: ServiceTime,
    runtime: tokio::runtime::Runtime,
}

impl Sim {
    fn run(&self, point: &Point, seed: u64) -> anyhow::Result<LoadReport> {
        let (setups, _) = sim_devices(
            point.speeds,
            self.service,
            Duration::ZERO,
            self.args.replicas,
            BatchingSpec::OFF,
            0.0,
            seed,
        );
        let router = Arc::new(Scheduler::start(
            setups,
            SchedulerConfig {
                routing: point.routing,
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
                requests: self.args.requests,
                sizes: SizeClass::uniform(Duration::from_secs(60)),
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
    let sim = Sim {
        args: args.clone(),
        service,
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
        arrivals: Arrivals::Closed {
            concurrency: 4 * args.replicas,
        },
    };
    let mut unit = Rows {
        label: "1 device, saturated (closed loop)".into(),
        reports: Vec::new(),
    };
    for r in 0..repeats {
        unit.reports
            .push(sim.run(&reference, args.seed + r as u64)?);
    }
    let unit_rps = unit.median(|r| r.throughput_rps);
    print_header();
    print_row(&unit);
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
                arrivals: Arrivals::Poisson { rate_per_s: rate },
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
            arrivals: Arrivals::Closed {
                concurrency: 8 * 4 * args.replicas,
            },
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
            arrivals: Arrivals::Closed {
                concurrency: 4 * args.replicas,
            },
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
    println!();
    for v in verdicts {
        println!("{v}");
    }
    Ok(())
}
