//! How long a request's answer takes once its run has ended: the handler's wake-up, the
//! wait for a blocking thread and the encode there. Learned online for each kind of
//! answer, as a device's runs are (`CostModel`: a fixed part and a part per pixel), with a
//! margin from the slowest of the newest answers. The scheduler keeps it off the
//! request's deadline (`Terms::answer`): a run that ends at its deadline answers late by
//! it, and on two busy cores a 12 MP photo's request spent 55 to 180 ms (p1 to p99)
//! outside its queue and run: its decode before, its alpha's PNG after.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::codec::ImageFormat;
use crate::sched::cost::CostModel;
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

/// One kind's answers: the fit of their times, and the newest answers' times against
/// what they were priced at.
#[derive(Debug, Default)]
struct Kind {
    fit: CostModel,
    /// (pixels, time / price) of the newest answers.
    overruns: Mutex<VecDeque<(u64, f64)>>,
}

impl Kind {
    /// The slowest ratio among the newest answers at least half as large as `work`, at
    /// least 1. Not the slowest of all: a 320x320 alpha's PNG is priced at about a
    /// millisecond, so a few milliseconds of a thread's wake-up make its ratio several
    /// times what a 12 MP answer's is, and put on the 12 MP price that would keep
    /// hundreds of milliseconds the large answers never take.
    fn margin(&self, work: Work) -> f64 {
        let overruns = self.overruns.lock().unwrap_or_else(|p| p.into_inner());
        overruns
            .iter()
            .filter(|&&(pixels, _)| pixels.saturating_mul(2) >= work.pixels)
            .map(|&(_, ratio)| ratio)
            .fold(1.0, f64::max)
    }

    fn observe(&self, work: Work, priced: Option<Duration>, took: Duration) {
        if let Some(priced) = priced.filter(|p| !p.is_zero()) {
            let ratio = took.as_secs_f64() / priced.as_secs_f64();
            if ratio.is_finite() {
                let mut overruns = self.overruns.lock().unwrap_or_else(|p| p.into_inner());
                if overruns.len() == MARGIN_ANSWERS {
                    overruns.pop_front();
                }
                overruns.push_back((work.pixels, ratio));
            }
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
    /// What an answer of `kind` for `work` is to be allowed after its run: its price
    /// times its margin, once answers of its kind and of a size near it have been made
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
        let kept = priced.map_or(Duration::ZERO, |p| p.mul_f64(model.margin(work)));
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
    fn the_allowance_grows_with_the_pixels_and_keeps_the_slowest_of_its_size() {
        let times = AnswerTimes::default();
        for _ in 0..20 {
            answer(&times, ALPHA, 100_000, MS);
            answer(&times, ALPHA, 12_000_000, 60 * MS);
        }
        let large = times.allowance(ALPHA, work(12_000_000)).kept();
        assert!(large >= 55 * MS && large <= 65 * MS, "{large:?}");
        // A small answer 5x its price does not widen the large's margin...
        answer(&times, ALPHA, 100_000, 5 * MS);
        let large = times.allowance(ALPHA, work(12_000_000)).kept();
        assert!(large <= 70 * MS, "{large:?}");
        // ...a large one 2x its price does, the small's too.
        answer(&times, ALPHA, 12_000_000, 120 * MS);
        let large = times.allowance(ALPHA, work(12_000_000)).kept();
        assert!(large >= 110 * MS, "{large:?}");
        let small = times.allowance(ALPHA, work(100_000)).kept();
        assert!(small >= 4 * MS, "{small:?}");
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
        // The fit still remembers the slow one a little; its 4x margin is gone.
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
