//! The per-device cost model: a request's predicted service time from its size, learned
//! online from measured runs. A run is a fixed part (the models, at their input size
//! whatever the image's) and a part that grows with the pixels (resampling, trimap,
//! guided filter, the cut-out's composite). Routing, admission, queue order, `Retry-After`
//! and the wait gauges all price work with it; it never sees the pixels themselves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What a request asks of a device, as the cost model prices it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Work {
    /// The image's pixels: the stages around the models grow with them.
    pub pixels: u64,
    /// The run also composites a cut-out: one more pass over the pixels.
    pub composite: bool,
}

impl Work {
    pub fn of_image(width: u32, height: u32, composite: bool) -> Self {
        Self {
            pixels: u64::from(width) * u64::from(height),
            composite,
        }
    }
}

/// What an executor measured of one request's run, besides its wall time: the fixed part
/// (its model stages) and the composite's part. The rest of the run is the per-pixel part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunParts {
    pub fixed: Duration,
    pub composite: Duration,
}

/// A device's fitted prices, seconds: `fixed + per_pixel x pixels (+ composite_per_pixel x
/// pixels with a cut-out)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prices {
    pub fixed_s: f64,
    pub per_pixel_s: f64,
    pub composite_per_pixel_s: f64,
}

impl Prices {
    /// What a device is priced at before its first run, when no other device has been
    /// measured either: a CPU-like guess (100 ms for the models, 100 ns a pixel), replaced
    /// whole by the first measured run.
    pub const PRIOR: Prices = Prices {
        fixed_s: 0.1,
        per_pixel_s: 100e-9,
        composite_per_pixel_s: 0.0,
    };

    pub fn predict_s(&self, work: Work) -> f64 {
        let pixels = work.pixels as f64;
        let composite = if work.composite {
            self.composite_per_pixel_s * pixels
        } else {
            0.0
        };
        (self.fixed_s + self.per_pixel_s * pixels + composite).max(0.0)
    }

    pub fn predict(&self, work: Work) -> Duration {
        Duration::from_secs_f64(self.predict_s(work).min(3600.0))
    }
}

/// How much the newest run weighs against the fit's memory, once the first runs are in:
/// the fit follows a change of speed or of traffic within a few tens of runs. The first
/// runs weigh 1, 1/2, 1/3, ... (their sums start empty), so the cold start is the mean of
/// what was measured, not a blend with a guess.
const FORGET: f64 = 0.05;

/// Below this spread of pixel counts (as a share of their mean) the observed sizes cannot
/// tell a per-request offset from a per-pixel slope: the slope goes through the origin.
const SIZES_TOO_ALIKE: f64 = 0.05;

/// Exponentially forgetting sums of the observations: a weighted least-squares fit of
/// `variable = offset + slope x pixels`, and means of the fixed and composite parts.
#[derive(Debug, Default, Clone)]
struct Fit {
    runs: u64,
    /// The largest image measured: prices beyond twice it are an extrapolation.
    most_pixels: f64,
    /// Runs whose executor said what its fixed part was.
    with_parts: u64,
    /// Sum of weights, of pixels, of pixels², of variable parts, of pixels x variable.
    w: f64,
    x: f64,
    xx: f64,
    y: f64,
    xy: f64,
    /// Weighted sum of the fixed parts (over `w`).
    fixed: f64,
    /// Composite runs: their pixel and composite-time sums.
    composite_x: f64,
    composite_y: f64,
}

impl Fit {
    fn observe(&mut self, work: Work, per_request: Duration, parts: Option<RunParts>) {
        let total = per_request.as_secs_f64();
        let (fixed, composite) = match parts {
            Some(p) => {
                let fixed = p.fixed.as_secs_f64().min(total);
                let composite = if work.composite {
                    p.composite.as_secs_f64().min(total - fixed)
                } else {
                    0.0
                };
                (fixed, composite)
            }
            // Nothing known of the parts: the fit of the sizes separates them (below).
            None => (0.0, 0.0),
        };
        if parts.is_some() {
            self.with_parts += 1;
        }
        let variable = total - fixed - composite;
        let keep = 1.0 - FORGET;
        let x = work.pixels as f64;
        self.runs += 1;
        self.most_pixels = self.most_pixels.max(x);
        self.w = self.w * keep + 1.0;
        self.x = self.x * keep + x;
        self.xx = self.xx * keep + x * x;
        self.y = self.y * keep + variable;
        self.xy = self.xy * keep + x * variable;
        self.fixed = self.fixed * keep + fixed;
        if work.composite {
            self.composite_x = self.composite_x * keep + x;
            self.composite_y = self.composite_y * keep + composite;
        }
    }

    /// The mean time of a run, weighed as the prices are (the same memory): what a
    /// budget in service times is counted in where waits are priced by the fit.
    fn mean_run_s(&self) -> Option<f64> {
        (self.runs > 0 && self.w > 0.0).then(|| (self.fixed + self.y + self.composite_y) / self.w)
    }

    fn prices(&self) -> Option<Prices> {
        if self.runs == 0 || self.w <= 0.0 {
            return None;
        }
        let mean_x = self.x / self.w;
        let mean_y = self.y / self.w;
        let var_x = (self.xx / self.w - mean_x * mean_x).max(0.0);
        let (offset, slope) = if var_x.sqrt() > SIZES_TOO_ALIKE * mean_x && var_x > 0.0 {
            let cov = self.xy / self.w - mean_x * mean_y;
            let slope = (cov / var_x).max(0.0);
            // A negative offset would price small images below their measured time.
            ((mean_y - slope * mean_x).max(0.0), slope)
        } else if mean_x > 0.0 && self.with_parts > 0 {
            // The executor measured this part as growing with the pixels.
            (0.0, mean_y / mean_x)
        } else {
            // One size and nothing said of the parts: priced per request, as a count of
            // requests would price it, until sizes that differ come in.
            (mean_y, 0.0)
        };
        let composite_per_pixel_s = if self.composite_x > 0.0 {
            self.composite_y / self.composite_x
        } else {
            0.0
        };
        Some(Prices {
            fixed_s: self.fixed / self.w + offset,
            per_pixel_s: slope,
            composite_per_pixel_s,
        })
    }
}

/// How many of a device's newest runs its overrun is the slowest of.
const OVERRUN_RUNS: usize = 128;

/// How long a run's overrun counts, however few runs came after it. Where the margin
/// refuses the large requests and only small ones run, 128 runs can take a minute: after
/// a cold start whose first runs were slow, a server with a 1.5 s deadline refused every
/// 12 MP photo for 38 s while it answered 320x320 ones. Under full load 128 runs take
/// about 15 s on the 2-core machines, so the window of runs still binds first there.
const OVERRUN_AGE: Duration = Duration::from_secs(20);

/// The newest runs' times against the prices they were queued at. A price is a mean, and
/// a deadline kept on the mean is missed by every run slower than it: on the CPU, two
/// U2NetP replicas sharing the cores with the decodes and encodes of mixed traffic ran
/// from 0.6x to 4x their prices. The slowest ratio of the window is the margin deadlines
/// are kept with (the second slowest, or the slowest of 32, still let admitted requests
/// expire: see docs/decisions.md); a stalled run then makes the device refuse more for
/// its next 128 runs (or 20 s, `OVERRUN_AGE`), at once and with a `Retry-After`, rather
/// than answer late.
#[derive(Debug)]
struct Overruns {
    window: RecentMax,
    /// The least margin while the window holds fewer than `PRIOR_RUNS` runs.
    prior: f64,
}

/// The margin a device's deadlines are kept with before its window holds this many runs.
const PRIOR_RUNS: usize = 16;

/// That margin. With none, a server's first requests were admitted on their bare prices
/// and some expired (one to five in the first two seconds of each 1.5 s-deadline run,
/// its replicas warmed up), while the margin measured over the next 40 s of the same
/// traffic was 1.8 to 2.6.
const PRIOR_OVERRUN: f64 = 2.0;

impl Default for Overruns {
    fn default() -> Self {
        Self {
            window: RecentMax::new(OVERRUN_RUNS, 1.0, Some(OVERRUN_AGE)),
            prior: PRIOR_OVERRUN,
        }
    }
}

impl Overruns {
    fn observe(&mut self, ratio: f64) {
        self.window.observe(ratio, Instant::now());
    }

    /// The window's slowest ratio as of `now`, at least 1, and at least the prior while
    /// the window holds few runs.
    fn slowest(&self, now: Instant) -> f64 {
        let slowest = self.window.largest(now);
        if self.window.recent(now) < PRIOR_RUNS {
            slowest.max(self.prior)
        } else {
            slowest
        }
    }
}

/// The largest of the newest values: a margin read off what was measured lately (a
/// device's overruns, an answer kind's time over its price). At most `window` values are
/// kept, and where `max_age` is given, none older than it counts; the largest is at least
/// `floor`.
#[derive(Debug)]
pub(crate) struct RecentMax {
    window: usize,
    floor: f64,
    max_age: Option<Duration>,
    values: VecDeque<(Instant, f64)>,
}

impl RecentMax {
    pub fn new(window: usize, floor: f64, max_age: Option<Duration>) -> Self {
        Self {
            window: window.max(1),
            floor,
            max_age,
            values: VecDeque::new(),
        }
    }

    /// Records `value`, measured `at`, and returns the largest as of then.
    pub fn observe(&mut self, value: f64, at: Instant) -> f64 {
        if self.values.len() == self.window {
            self.values.pop_front();
        }
        self.values.push_back((at, value));
        self.largest(at)
    }

    /// The largest value recorded within `max_age` of `now`, at least `floor`.
    pub fn largest(&self, now: Instant) -> f64 {
        self.within(now)
            .map(|&(_, value)| value)
            .fold(self.floor, f64::max)
    }

    /// How many values recorded within `max_age` of `now` the window holds.
    pub fn recent(&self, now: Instant) -> usize {
        self.within(now).count()
    }

    fn within(&self, now: Instant) -> impl Iterator<Item = &(Instant, f64)> {
        self.values.iter().filter(move |(at, _)| {
            self.max_age
                .is_none_or(|age| now.saturating_duration_since(*at) <= age)
        })
    }

    pub fn clear(&mut self) {
        self.values.clear();
    }
}

/// One device's cost model: fitted on its replicas' threads, read lock-free by the router
/// (the fit publishes its prices into atomics after each run).
#[derive(Debug, Default)]
pub(crate) struct CostModel {
    fit: Mutex<Fit>,
    overruns: Mutex<Overruns>,
    /// `Prices` as f64 bits; `measured` is 0 until the first run (or seed).
    fixed_s: AtomicU64,
    per_pixel_s: AtomicU64,
    composite_per_pixel_s: AtomicU64,
    mean_run_s: AtomicU64,
    /// `Fit::most_pixels` as f64 bits (infinite once seeded).
    most_pixels: AtomicU64,
    measured: AtomicU64,
}

impl CostModel {
    pub fn observe(&self, work: Work, per_request: Duration, parts: Option<RunParts>) {
        let (prices, mean, most) = {
            let mut fit = self.fit.lock().unwrap_or_else(|p| p.into_inner());
            fit.observe(work, per_request, parts);
            (fit.prices(), fit.mean_run_s(), fit.most_pixels)
        };
        if let (Some(p), Some(mean)) = (prices, mean) {
            self.publish(p, mean, most);
        }
    }

    /// Prices the device as if one run of `work` had taken `per_request`, all of it fixed
    /// (a test's seed, a simulation's known speed): the runs that follow weigh in as
    /// usual.
    pub fn seed(&self, per_request: Duration) {
        let (prices, mean) = {
            let mut fit = self.fit.lock().unwrap_or_else(|p| p.into_inner());
            *fit = Fit::default();
            fit.observe(Work::default(), per_request, None);
            (fit.prices(), fit.mean_run_s())
        };
        // A seed prices every size alike, by decree: nothing it prices is extrapolated,
        // and its runs are kept with no margin but what they are measured to need.
        if let (Some(p), Some(mean)) = (prices, mean) {
            self.publish(p, mean, f64::INFINITY);
        }
        self.overruns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .prior = 1.0;
    }

    fn publish(&self, p: Prices, mean_run_s: f64, most_pixels: f64) {
        self.most_pixels
            .store(most_pixels.to_bits(), Ordering::Release);
        self.mean_run_s
            .store(mean_run_s.to_bits(), Ordering::Release);
        self.fixed_s.store(p.fixed_s.to_bits(), Ordering::Release);
        self.per_pixel_s
            .store(p.per_pixel_s.to_bits(), Ordering::Release);
        self.composite_per_pixel_s
            .store(p.composite_per_pixel_s.to_bits(), Ordering::Release);
        self.measured.store(1, Ordering::Release);
    }

    /// The mean run time the prices were fitted on, once a run has been measured.
    pub fn mean_run_s(&self) -> Option<f64> {
        if self.measured.load(Ordering::Acquire) == 0 {
            return None;
        }
        Some(f64::from_bits(self.mean_run_s.load(Ordering::Acquire)))
    }

    /// Whether the prices of `work` are measured, not extrapolated: a run has been
    /// measured, and of an image at least half as large. One 320x320 run's part beyond
    /// the model, put on its pixels, priced a 12 MP photo at 5 s where it takes 0.3 s
    /// (its per-request overheads read as per-pixel work); a price so far out is a
    /// guess, which orders but refuses nothing.
    pub fn covers(&self, work: Work) -> bool {
        self.measured.load(Ordering::Acquire) != 0
            && work.pixels as f64 <= 2.0 * f64::from_bits(self.most_pixels.load(Ordering::Acquire))
    }

    /// A probe's run (`Shared::may_probe` in the scheduler): sent although its price
    /// `priced` times the overrun (`worst`) refused it, it took `took`. Faster than
    /// priced, the prices were stale: the fit and the overruns start again from the runs
    /// that follow, this one first, as at a cold start. Within its price but faster than
    /// its worst, the margin was stale (a stall's overrun, kept for the next 128 runs,
    /// which it refused): the overruns start again. As slow as its worst, they stand.
    pub fn restart_if_overpriced(&self, priced: Duration, worst: Duration, took: Duration) {
        if took >= priced.max(worst) {
            return;
        }
        if took < priced {
            *self.fit.lock().unwrap_or_else(|p| p.into_inner()) = Fit::default();
        }
        self.overruns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .window
            .clear();
    }

    /// Records how long a run priced at `priced` took (`took`), measured prices only: a
    /// guess's error is the prior's, not the device's.
    pub fn observe_overrun(&self, priced: Duration, took: Duration) {
        if priced.is_zero() {
            return;
        }
        let ratio = took.as_secs_f64() / priced.as_secs_f64();
        if !ratio.is_finite() {
            return;
        }
        self.overruns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(ratio);
    }

    /// The slowest of the newest runs against its price, at least 1: a deadline is kept
    /// by a run priced at `price x overrun`.
    pub fn overrun(&self) -> f64 {
        self.overruns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .slowest(Instant::now())
    }

    /// The fitted prices, once a run has been measured.
    pub fn prices(&self) -> Option<Prices> {
        if self.measured.load(Ordering::Acquire) == 0 {
            return None;
        }
        let read = |a: &AtomicU64| f64::from_bits(a.load(Ordering::Acquire));
        Some(Prices {
            fixed_s: read(&self.fixed_s),
            per_pixel_s: read(&self.per_pixel_s),
            composite_per_pixel_s: read(&self.composite_per_pixel_s),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Work = Work {
        pixels: 320 * 320,
        composite: false,
    };
    const LARGE: Work = Work {
        pixels: 4032 * 3024,
        composite: false,
    };

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    /// A device whose runs take 140 ms of models plus 200 ns a pixel.
    fn truth(work: Work) -> (Duration, RunParts) {
        let variable = 200e-9 * work.pixels as f64;
        (
            Duration::from_secs_f64(0.140 + variable),
            RunParts {
                fixed: ms(140.0),
                composite: Duration::ZERO,
            },
        )
    }

    #[test]
    fn an_unmeasured_device_has_no_prices_and_the_first_run_replaces_the_prior() {
        let model = CostModel::default();
        assert_eq!(model.prices(), None);
        let (t, parts) = truth(LARGE);
        model.observe(LARGE, t, Some(parts));
        let p = model.prices().expect("measured");
        // One size seen: the per-pixel part goes through the origin, and both sizes are
        // priced from that one run, not from the prior.
        assert!((p.predict_s(LARGE) - t.as_secs_f64()).abs() < 1e-9);
        let small = truth(SMALL).0.as_secs_f64();
        assert!((p.predict_s(SMALL) - small).abs() < 1e-6, "{p:?}");
        assert!(Prices::PRIOR.predict_s(SMALL) > 0.0);
    }

    #[test]
    fn a_price_beyond_twice_the_largest_image_measured_is_not_covered() {
        let model = CostModel::default();
        assert!(!model.covers(SMALL), "nothing measured");
        let (t, parts) = truth(SMALL);
        model.observe(SMALL, t, Some(parts));
        assert!(model.covers(SMALL));
        assert!(!model.covers(LARGE), "extrapolated from a small image");
        let (t, parts) = truth(LARGE);
        model.observe(LARGE, t, Some(parts));
        assert!(model.covers(LARGE) && model.covers(SMALL));
        // A seed prices every size.
        let seeded = CostModel::default();
        seeded.seed(Duration::from_millis(10));
        assert!(seeded.covers(LARGE));
    }

    #[test]
    fn mixed_sizes_fit_the_fixed_and_per_pixel_parts() {
        let model = CostModel::default();
        for i in 0..40 {
            let work = if i % 2 == 0 { SMALL } else { LARGE };
            let (t, parts) = truth(work);
            model.observe(work, t, Some(parts));
        }
        let p = model.prices().expect("measured");
        assert!((p.fixed_s - 0.140).abs() < 1e-6, "{p:?}");
        assert!((p.per_pixel_s - 200e-9).abs() < 1e-12, "{p:?}");
        let ratio = p.predict_s(LARGE) / p.predict_s(SMALL);
        assert!(
            ratio > 15.0,
            "a 12 MP photo is priced {ratio}x a 320x320 one"
        );
    }

    #[test]
    fn without_parts_the_offset_comes_from_the_sizes() {
        // An executor that says nothing of its parts: sizes that differ still separate a
        // per-request offset from a per-pixel slope.
        let model = CostModel::default();
        for i in 0..40 {
            let work = if i % 2 == 0 { SMALL } else { LARGE };
            model.observe(work, truth(work).0, None);
        }
        let p = model.prices().expect("measured");
        assert!((p.predict_s(SMALL) - truth(SMALL).0.as_secs_f64()).abs() < 1e-3);
        assert!((p.predict_s(LARGE) - truth(LARGE).0.as_secs_f64()).abs() < 1e-3);
    }

    #[test]
    fn the_fit_follows_a_change_of_speed() {
        let model = CostModel::default();
        for _ in 0..50 {
            let (t, parts) = truth(SMALL);
            model.observe(SMALL, t, Some(parts));
        }
        // The device gets twice as slow.
        for _ in 0..100 {
            let (t, parts) = truth(SMALL);
            let parts = RunParts {
                fixed: parts.fixed * 2,
                ..parts
            };
            model.observe(SMALL, t * 2, Some(parts));
        }
        let p = model.prices().expect("measured");
        let expected = 2.0 * truth(SMALL).0.as_secs_f64();
        assert!((p.predict_s(SMALL) / expected - 1.0).abs() < 0.01, "{p:?}");
    }

    #[test]
    fn a_cut_out_costs_its_composite_on_top() {
        let model = CostModel::default();
        let with = Work {
            composite: true,
            ..LARGE
        };
        let (t, parts) = truth(LARGE);
        model.observe(LARGE, t, Some(parts));
        let composite = Duration::from_secs_f64(30e-9 * LARGE.pixels as f64);
        model.observe(with, t + composite, Some(RunParts { composite, ..parts }));
        let p = model.prices().expect("measured");
        let extra = p.predict_s(with) - p.predict_s(LARGE);
        assert!((extra - composite.as_secs_f64()).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn the_overrun_is_the_slowest_of_the_newest_runs_and_never_below_one() {
        let model = CostModel::default();
        assert_eq!(
            model.overrun(),
            PRIOR_OVERRUN,
            "nothing recorded: the prior"
        );
        for _ in 0..PRIOR_RUNS - 1 {
            model.observe_overrun(ms(100.0), ms(80.0));
        }
        assert_eq!(model.overrun(), PRIOR_OVERRUN, "too few runs: the prior");
        model.observe_overrun(ms(100.0), ms(80.0));
        assert_eq!(model.overrun(), 1.0, "runs faster than their price");
        model.observe_overrun(ms(100.0), ms(130.0));
        assert!((model.overrun() - 1.3).abs() < 1e-9, "{}", model.overrun());
        model.observe_overrun(Duration::ZERO, ms(50.0));
        assert!(
            (model.overrun() - 1.3).abs() < 1e-9,
            "an unpriced run is not recorded"
        );
        // The slow run leaves the window after `OVERRUN_RUNS` newer ones.
        for _ in 0..OVERRUN_RUNS - 1 {
            model.observe_overrun(ms(100.0), ms(110.0));
        }
        assert!((model.overrun() - 1.3).abs() < 1e-9);
        model.observe_overrun(ms(100.0), ms(110.0));
        assert!((model.overrun() - 1.1).abs() < 1e-9, "{}", model.overrun());
    }

    #[test]
    fn a_seed_prices_every_size_alike_until_runs_come_in() {
        let model = CostModel::default();
        model.seed(ms(10.0));
        let p = model.prices().expect("seeded");
        assert!((p.predict_s(LARGE) - 0.010).abs() < 1e-9);
        assert!((p.predict_s(SMALL) - 0.010).abs() < 1e-9);
        // By decree: no prior margin either.
        assert_eq!(model.overrun(), 1.0);
    }

    #[test]
    fn the_recent_max_keeps_a_window_of_values_and_forgets_old_ones() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut aged = RecentMax::new(3, 0.0, Some(Duration::from_secs(10)));
        assert_eq!(aged.observe(5.0, at(0)), 5.0);
        assert_eq!(aged.observe(2.0, at(1)), 5.0);
        // Older than 10 s: no longer counted, though still in the window.
        assert_eq!(aged.largest(at(11)), 2.0);
        assert_eq!(aged.largest(at(12)), 0.0);
        let mut windowed = RecentMax::new(3, 1.0, None);
        windowed.observe(4.0, at(0));
        for s in 1..=3 {
            windowed.observe(0.5, at(s));
        }
        // The 4 has left the window of three; the floor stands in for the halves.
        assert_eq!(windowed.largest(at(1000)), 1.0);
    }

    #[test]
    fn a_probe_faster_than_its_price_restarts_the_prices_and_a_slower_one_keeps_them() {
        let model = CostModel::default();
        // A cold start: the first runs 10x what the device takes since.
        for _ in 0..20 {
            model.observe(SMALL, ms(1500.0), None);
            model.observe_overrun(ms(300.0), ms(1500.0));
        }
        let stale = model.prices().expect("measured").predict(SMALL);
        assert!(stale >= ms(1400.0), "{stale:?}");
        // Confirmed: a probe that took its worst changes nothing but its own weight.
        let worst = stale.mul_f64(model.overrun());
        model.restart_if_overpriced(stale, worst, worst);
        assert!(model.overrun() >= 5.0, "{}", model.overrun());
        // Within its price, but not near its worst: only the margin was stale, and starts
        // again from its prior.
        model.restart_if_overpriced(stale, worst, stale);
        assert_eq!(model.overrun(), PRIOR_OVERRUN);
        assert_eq!(model.prices().expect("measured").predict(SMALL), stale);
        model.observe_overrun(ms(300.0), ms(1500.0));
        // Refuted: the probe's run alone prices the device.
        model.restart_if_overpriced(stale, worst, ms(150.0));
        model.observe(SMALL, ms(150.0), None);
        let fresh = model.prices().expect("measured").predict(SMALL);
        assert!(fresh <= ms(151.0) && fresh >= ms(149.0), "{fresh:?}");
        assert_eq!(model.overrun(), PRIOR_OVERRUN);
    }
}
