//! How long a request's answer takes once its run has ended: the handler's wake-up, the
//! wait for a blocking thread and the encode there. Learned online for each kind of
//! answer, as a device's runs are (`CostModel`: a fixed part and a part per pixel), plus
//! the most the newest answers took over their prices. The scheduler keeps it off the
//! request's deadline (`Terms::answer`): a run that ends at its deadline answers late by
//! it, and on two busy cores a 12 MP photo's request spent 55 to 180 ms (p1 to p99)
//! outside its queue and run: its decode before, its alpha's PNG after.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::codec::ImageFormat;
use crate::sched::cost::{CostModel, RecentMax};
use crate::sched::Work;
use crate::spec::OutputKind;

/// What an answer is made as: kinds cost differently for the same pixels (a cut-out's PNG
/// is four planes where an alpha's is one; a v2 tensor is text or raw bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnswerKind {
    /// `/invocations`: the image asked for, or the JSON of all three.
    Image {
        output: OutputKind,
        format: ImageFormat,
    },
    /// The Open Inference Protocol over REST.
    V2Rest,
    /// The Open Inference Protocol over gRPC.
    V2Grpc,
}

/// How many of a kind's newest answers its margin is read from.
const MARGIN_ANSWERS: usize = 64;

/// How long an answer's time over its price counts in its kind's margin. Answers come
/// only from admitted requests, so a margin that refused every request would otherwise
/// keep its slowest answer for good: after a stall of seconds, a server with a 1.5 s
/// deadline would refuse everything from then on. The same time as a device's probe
/// (`sched::REPROBE_AFTER`), after which a run measures the device again.
const MARGIN_AGE: Duration = crate::sched::REPROBE_AFTER;

/// One kind's answers: the fit of their times, and how much longer than their prices the
/// newest took.
#[derive(Debug)]
struct Kind {
    fit: CostModel,
    /// Seconds over its price (0 when under) of each of the newest answers.
    excesses: Mutex<RecentMax>,
}

impl Default for Kind {
    fn default() -> Self {
        Self {
            fit: CostModel::default(),
            excesses: Mutex::new(RecentMax::new(MARGIN_ANSWERS, 0.0, Some(MARGIN_AGE))),
        }
    }
}

impl Kind {
    /// The most any of the newest answers took over its price, whatever its size: an
    /// added time, not a ratio as the runs' margin is. What an answer overruns by is
    /// mostly waiting (a thread's wake-up, a blocking thread on busy cores), which does
    /// not grow with the answer; and answers are priced at milliseconds. As a ratio, in a
    /// CI run a lone request to an idle replica (runs of 0.4-0.5 s, 0.13 s besides) was
    /// refused as expected in 4.7 s against its 3 s.
    fn margin(&self) -> Duration {
        let excesses = self.excesses.lock().unwrap_or_else(|p| p.into_inner());
        Duration::from_secs_f64(excesses.largest(Instant::now()))
    }

    fn observe(&self, work: Work, priced: Option<Duration>, took: Duration) {
        if let Some(priced) = priced {
            let excess = took.saturating_sub(priced).as_secs_f64();
            self.excesses
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .observe(excess, Instant::now());
        }
        self.fit.observe(work, took, None);
    }
}

/// The answers' times, by kind.
#[derive(Debug, Default)]
pub struct AnswerTimes {
    kinds: Mutex<HashMap<AnswerKind, Arc<Kind>>>,
}

impl AnswerTimes {
    /// What an answer of `kind` for `work` is to be allowed after its run: its price and
    /// the kind's margin, once answers of its kind and of a size near it have been made
    /// (nothing before: a guess refuses nothing, as the devices' prior does not).
    pub fn allowance(&self, kind: AnswerKind, work: Work) -> Allowance {
        let model = self
            .kinds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kind)
            .or_default()
            .clone();
        let priced = model
            .fit
            .covers(work)
            .then(|| model.fit.prices())
            .flatten()
            .map(|prices| prices.predict(work));
        let kept = priced.map_or(Duration::ZERO, |p| p + model.margin());
        Allowance {
            model,
            work,
            priced,
            kept,
        }
    }
}

/// One request's allowance for its answer, and where the answer's time goes once made.
#[derive(Debug)]
pub struct Allowance {
    model: Arc<Kind>,
    work: Work,
    priced: Option<Duration>,
    kept: Duration,
}

impl Allowance {
    /// The time kept for the answer after the run.
    pub fn kept(&self) -> Duration {
        self.kept
    }

    /// The answer is made now; its run ended at `run_ended`.
    pub fn answered(self, run_ended: Instant) {
        let took = run_ended.elapsed();
        self.model.observe(self.work, self.priced, took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALPHA: AnswerKind = AnswerKind::Image {
        output: OutputKind::Alpha,
        format: ImageFormat::Png,
    };

    fn work(pixels: u64) -> Work {
        Work {
            pixels,
            composite: false,
        }
    }

    fn answer(times: &AnswerTimes, kind: AnswerKind, pixels: u64, took: Duration) -> Duration {
        let allowance = times.allowance(kind, work(pixels));
        let kept = allowance.kept();
        allowance
            .model
            .observe(allowance.work, allowance.priced, took);
        kept
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn nothing_is_kept_before_an_answer_of_the_kind_and_size_is_made() {
        let times = AnswerTimes::default();
        assert_eq!(answer(&times, ALPHA, 100_000, 2 * MS), Duration::ZERO);
        // Measured now, but 12 MP is over twice the largest made: a guess.
        assert_eq!(
            times.allowance(ALPHA, work(12_000_000)).kept(),
            Duration::ZERO
        );
        assert_eq!(
            times.allowance(AnswerKind::V2Rest, work(100_000)).kept(),
            Duration::ZERO
        );
        assert!(times.allowance(ALPHA, work(100_000)).kept() > Duration::ZERO);
    }

    #[test]
    fn the_allowance_is_the_price_by_size_plus_the_most_an_answer_took_over_it() {
        let times = AnswerTimes::default();
        for _ in 0..20 {
            answer(&times, ALPHA, 100_000, MS);
            answer(&times, ALPHA, 12_000_000, 60 * MS);
        }
        let large = times.allowance(ALPHA, work(12_000_000)).kept();
        assert!(large >= 55 * MS && large <= 65 * MS, "{large:?}");
        let small = times.allowance(ALPHA, work(100_000)).kept();
        assert!(small <= 5 * MS, "{small:?}");
        // A wait of 100 ms on a small answer is added to any answer's price, not
        // multiplied into it (100x the small one's price).
        answer(&times, ALPHA, 100_000, 101 * MS);
        let small = times.allowance(ALPHA, work(100_000)).kept();
        assert!(small >= 100 * MS && small <= 120 * MS, "{small:?}");
        let large = times.allowance(ALPHA, work(12_000_000)).kept();
        assert!(large >= 155 * MS && large <= 175 * MS, "{large:?}");
    }

    #[test]
    fn the_margin_forgets_answers_past_its_window() {
        let times = AnswerTimes::default();
        answer(&times, ALPHA, 1_000_000, 10 * MS);
        answer(&times, ALPHA, 1_000_000, 40 * MS);
        for _ in 0..MARGIN_ANSWERS {
            answer(&times, ALPHA, 1_000_000, 10 * MS);
        }
        let kept = times.allowance(ALPHA, work(1_000_000)).kept();
        // The fit still remembers the slow one a little; its 30 ms over its price is gone.
        assert!(kept < 15 * MS, "{kept:?}");
    }

    #[test]
    fn kinds_are_learned_apart() {
        let times = AnswerTimes::default();
        let cutout = AnswerKind::Image {
            output: OutputKind::Cutout,
            format: ImageFormat::Png,
        };
        for _ in 0..5 {
            answer(&times, ALPHA, 1_000_000, 5 * MS);
            answer(&times, cutout, 1_000_000, 50 * MS);
        }
        assert!(times.allowance(ALPHA, work(1_000_000)).kept() < 10 * MS);
        assert!(times.allowance(cutout, work(1_000_000)).kept() > 40 * MS);
    }
}
