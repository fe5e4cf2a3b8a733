//! Results of a benchmark point and their presentations: the terminal table, JSON, CSV,
//! and the latency-versus-throughput plot of a sweep.

use std::collections::BTreeMap;
use std::path::Path;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::stats::{median, quantile};

/// One measured point of a sweep (a concurrency or an offered rate).
#[derive(Debug, Clone, Serialize)]
pub struct PointReport {
    /// What the point is, e.g. `c=4` or `rate=10/s poisson`.
    pub point: String,
    /// Requests sent in the measured window (their latencies are the percentiles), and
    /// how many of them succeeded.
    pub requests: u64,
    pub ok: u64,
    /// Of the successes, those slower than the client's deadline (`bench http
    /// --deadline-ms`); `None` without one.
    pub late: Option<u64>,
    /// The measured window's length (a run stopped early by a request count: to its
    /// last answer).
    pub duration_s: f64,
    /// Successful responses per second: those that arrived in the window, over its
    /// length (`bench::http::throughput`).
    pub throughput_rps: f64,
    pub latency_ms: Percentiles,
    /// Non-2xx answers and transport failures, by status (`"503"`, `"transport"`).
    pub errors: BTreeMap<String, u64>,
    /// Median server-side time of each stage, from the `Server-Timing` header.
    pub server_stages_ms: BTreeMap<String, f64>,
    /// The server process's CPU time per completed request over the measured window
    /// (`bench http --server-pid`; Linux), all its threads: with the cores saturated,
    /// throughput is the cores over this.
    pub server_cpu_ms_per_request: Option<f64>,
    /// The load generator's own CPU time per completed request, on the same machine.
    pub client_cpu_ms_per_request: Option<f64>,
    /// Each input's own figures, when there are several (`bench http --input` given more
    /// than once): under mixed traffic, a small image's latency is not a large one's.
    pub by_input: Vec<InputReport>,
}

/// One input's share of a point.
#[derive(Debug, Clone, Serialize)]
pub struct InputReport {
    /// Its name: the file's, or the folder's.
    pub input: String,
    pub requests: u64,
    pub ok: u64,
    pub late: Option<u64>,
    pub latency_ms: Percentiles,
    pub errors: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub p999: f64,
    pub mean: f64,
}

impl Percentiles {
    /// From a histogram of microseconds.
    pub fn from_us(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
        Self {
            p50: ms(0.5),
            p90: ms(0.9),
            p95: ms(0.95),
            p99: ms(0.99),
            p999: ms(0.999),
            mean: h.mean() / 1e3,
        }
    }
}

/// `(stage, p50, p90, p99)` in ms of each pipeline stage, with a `total` row.
pub fn stage_percentiles(
    timings: &[crate::matte::StageTimings],
) -> Vec<(&'static str, f64, f64, f64)> {
    let pick = |f: &dyn Fn(&crate::matte::StageTimings) -> f64| -> (f64, f64, f64) {
        let mut v: Vec<f64> = timings.iter().map(f).collect();
        let p50 = median(&mut v);
        let at = |q: f64| quantile(&v, q).unwrap_or(0.0);
        (p50, at(0.9), at(0.99))
    };
    let names = crate::matte::StageTimings::default().stages();
    let mut rows: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let (a, b, c) = pick(&|t| t.stages()[i].1.as_secs_f64() * 1e3);
            (*name, a, b, c)
        })
        .collect();
    let (a, b, c) = pick(&|t| t.stages().iter().map(|s| s.1.as_secs_f64() * 1e3).sum());
    rows.push(("total", a, b, c));
    rows
}

/// The table printed at the end of a run.
pub fn table(points: &[PointReport]) -> String {
    let mut out = format!(
        "{:<20} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}  {}\n",
        "point",
        "req/s",
        "p50 ms",
        "p90 ms",
        "p95 ms",
        "p99 ms",
        "p99.9 ms",
        "errors",
        "server stages (median ms)"
    );
    for p in points {
        let errors: u64 = p.errors.values().sum();
        let stages = p
            .server_stages_ms
            .iter()
            .map(|(k, v)| format!("{k} {v:.1}"))
            .collect::<Vec<_>>()
            .join(", ");
        out += &format!(
            "{:<20} {:>9.2} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8}  {}\n",
            p.point,
            p.throughput_rps,
            p.latency_ms.p50,
            p.latency_ms.p90,
            p.latency_ms.p95,
            p.latency_ms.p99,
            p.latency_ms.p999,
            errors,
            stages
        );
        for input in &p.by_input {
            let l = &input.latency_ms;
            let late = input.late.map_or(String::new(), |n| format!(" ({n} late)"));
            out += &format!(
                "{:<20} {:>9} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8}  {} ok{late}\n",
                format!("  {}", input.input),
                "",
                l.p50,
                l.p90,
                l.p95,
                l.p99,
                l.p999,
                input.errors.values().sum::<u64>(),
                input.ok,
            );
        }
        if let (Some(late), true) = (p.late, p.by_input.is_empty()) {
            out += &format!("{:<20} {late} answered after the deadline\n", "");
        }
    }
    out
}

pub fn write_json(path: &Path, points: &[PointReport]) -> std::io::Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(points)?)
}

pub fn write_csv(path: &Path, points: &[PointReport]) -> std::io::Result<()> {
    let mut out = String::from(
        "point,requests,ok,duration_s,throughput_rps,p50_ms,p90_ms,p95_ms,p99_ms,p999_ms,mean_ms,errors\n",
    );
    for p in points {
        let l = &p.latency_ms;
        out += &format!(
            "{},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{}\n",
            p.point.replace(',', ";"),
            p.requests,
            p.ok,
            p.duration_s,
            p.throughput_rps,
            l.p50,
            l.p90,
            l.p95,
            l.p99,
            l.p999,
            l.mean,
            p.errors.values().sum::<u64>()
        );
    }
    std::fs::write(path, out)
}

/// Why a plot could not be drawn or written (plotters' SVG backend writes a file).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct PlotError(#[from] plotters::drawing::DrawingAreaErrorKind<std::io::Error>);

/// p50 and p99 latency against throughput, one marker per point, as SVG.
pub fn write_plot(path: &Path, title: &str, points: &[PointReport]) -> Result<(), PlotError> {
    use plotters::prelude::*;
    let max_x = points.iter().map(|p| p.throughput_rps).fold(0.0, f64::max) * 1.1 + 1e-9;
    let max_y = points.iter().map(|p| p.latency_ms.p99).fold(0.0, f64::max) * 1.1 + 1e-9;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_x, 0.0..max_y)?;
    chart
        .configure_mesh()
        .x_desc("throughput (requests/s)")
        .y_desc("latency (ms)")
        .draw()?;
    for (name, color, pick) in [
        (
            "p50",
            BLUE,
            (|p: &PointReport| p.latency_ms.p50) as fn(&PointReport) -> f64,
        ),
        ("p99", RED, |p: &PointReport| p.latency_ms.p99),
    ] {
        let series: Vec<(f64, f64)> = points.iter().map(|p| (p.throughput_rps, pick(p))).collect();
        chart
            .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(
            series
                .into_iter()
                .map(|xy| Circle::new(xy, 4, color.filled())),
        )?;
    }
    chart.configure_series_labels().border_style(BLACK).draw()?;
    Ok(root.present()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_from_a_histogram() {
        let mut h = Histogram::<u64>::new(3).unwrap();
        for us in 1..=1000u64 {
            h.record(us * 1000).unwrap();
        }
        let p = Percentiles::from_us(&h);
        assert!((p.p50 - 500.0).abs() < 1.0, "{p:?}");
        assert!((p.p99 - 990.0).abs() < 2.0, "{p:?}");
    }

    #[test]
    fn table_and_csv_carry_every_point() {
        let point = PointReport {
            point: "c=4".into(),
            requests: 10,
            ok: 9,
            duration_s: 2.0,
            throughput_rps: 4.5,
            latency_ms: Percentiles::default(),
            errors: BTreeMap::from([("503".to_string(), 1)]),
            server_stages_ms: BTreeMap::from([("model".to_string(), 120.0)]),
            server_cpu_ms_per_request: None,
            client_cpu_ms_per_request: None,
            late: Some(2),
            by_input: ["small.jpg", "large.jpg"]
                .iter()
                .map(|name| InputReport {
                    input: name.to_string(),
                    requests: 5,
                    ok: 5,
                    late: Some(1),
                    latency_ms: Percentiles::default(),
                    errors: BTreeMap::new(),
                })
                .collect(),
        };
        let t = table(std::slice::from_ref(&point));
        assert!(
            t.contains("c=4") && t.contains("4.50") && t.contains("model 120.0"),
            "{t}"
        );
        assert!(
            t.contains("  small.jpg") && t.contains("  large.jpg") && t.contains("(1 late)"),
            "{t}"
        );
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("x.csv");
        write_csv(&csv, std::slice::from_ref(&point)).unwrap();
        let text = std::fs::read_to_string(&csv).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert!(text.lines().nth(1).unwrap().starts_with("c=4,10,9,"));
        let svg = dir.path().join("x.svg");
        write_plot(&svg, "t", &[point]).unwrap();
        assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    }
}
