//! Activation ranges from calibration: each measured tensor's values over every
//! calibration image, reduced to the range its 8-bit form will cover. Three methods, as
//! ONNX Runtime's and TensorRT's calibrators offer: `minmax` (the extremes seen),
//! `percentile` (the extremes with the rarest 0.01 % clipped) and `entropy` (the clip
//! that keeps the 8-bit histogram closest to the real one, by Kullback-Leibler
//! divergence, TensorRT's method). The last two need a histogram, so they take a second
//! pass over the images with the first pass's extremes fixing the bins.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How a tensor's range is chosen from what calibration saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    MinMax,
    #[default]
    Percentile,
    Entropy,
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::MinMax => "minmax",
            Self::Percentile => "percentile",
            Self::Entropy => "entropy",
        })
    }
}

impl FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "minmax" => Ok(Self::MinMax),
            "percentile" => Ok(Self::Percentile),
            "entropy" => Ok(Self::Entropy),
            other => Err(format!(
                "`{other}`: the calibration method is minmax, percentile or entropy"
            )),
        }
    }
}

impl Method {
    /// Whether it needs the second, histogram pass.
    pub fn needs_histogram(self) -> bool {
        self != Self::MinMax
    }
}

/// The share of values `percentile` clips at each end.
const PERCENTILE_CLIP: f64 = 1e-4;
/// Histogram bins over a tensor's range.
pub const BINS: usize = 2048;

/// A tensor's range, zero always inside it (an 8-bit form must hold 0 exactly: padding).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range {
    pub min: f32,
    pub max: f32,
}

impl Range {
    pub const EMPTY: Range = Range {
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
    };

    pub fn observe(&mut self, values: &[f32]) {
        for &v in values {
            if v.is_finite() {
                self.min = self.min.min(v);
                self.max = self.max.max(v);
            }
        }
    }

    /// Widened to hold 0; an empty range is [0, 0].
    pub fn with_zero(self) -> Range {
        if self.min > self.max {
            return Range { min: 0.0, max: 0.0 };
        }
        Range {
            min: self.min.min(0.0),
            max: self.max.max(0.0),
        }
    }
}

/// The values of one tensor over [-bound, bound] (signed) or [0, bound], in `BINS` bins
/// of |value| (the side a value is on kept apart, so percentile clips each end).
#[derive(Debug, Clone)]
pub struct Histogram {
    bound: f32,
    positive: Vec<u64>,
    negative: Vec<u64>,
}

impl Histogram {
    /// Bins for values within `range` (after the first pass).
    pub fn new(range: Range) -> Self {
        let r = range.with_zero();
        Self {
            bound: r.max.max(-r.min).max(f32::MIN_POSITIVE),
            positive: vec![0; BINS],
            negative: vec![0; BINS],
        }
    }

    pub fn observe(&mut self, values: &[f32]) {
        let per_bin = BINS as f32 / self.bound;
        for &v in values {
            if !v.is_finite() {
                continue;
            }
            let bin = ((v.abs() * per_bin) as usize).min(BINS - 1);
            if v < 0.0 {
                self.negative[bin] += 1;
            } else {
                self.positive[bin] += 1;
            }
        }
    }

    fn bin_width(&self) -> f32 {
        self.bound / BINS as f32
    }

    /// The value below which all but `clip` of one side's values lie, of all values.
    fn clipped_end(&self, side: &[u64], total: u64) -> f32 {
        let side_total: u64 = side.iter().sum();
        if side_total == 0 {
            return 0.0;
        }
        let allowed = (PERCENTILE_CLIP * total as f64) as u64;
        let mut above = 0u64;
        for (i, &count) in side.iter().enumerate().rev() {
            above += count;
            if above > allowed {
                return (i + 1) as f32 * self.bin_width();
            }
        }
        self.bin_width()
    }

    /// The range `method` picks from this histogram.
    pub fn range(&self, method: Method, seen: Range) -> Range {
        let seen = seen.with_zero();
        match method {
            Method::MinMax => seen,
            Method::Percentile => {
                let total: u64 = self.positive.iter().chain(&self.negative).sum();
                Range {
                    min: -self.clipped_end(&self.negative, total).min(-seen.min),
                    max: self.clipped_end(&self.positive, total).min(seen.max),
                }
            }
            Method::Entropy => {
                let negatives: u64 = self.negative.iter().sum();
                if negatives == 0 {
                    // All at or above zero (a ReLU's output): 256 levels over [0, t].
                    let t = entropy_threshold(&self.positive, 256) as f32 * self.bin_width();
                    Range {
                        min: 0.0,
                        max: t.min(seen.max),
                    }
                } else {
                    // Both signs: 128 levels a side, over [-t, t] of |x|.
                    let both: Vec<u64> = self
                        .positive
                        .iter()
                        .zip(&self.negative)
                        .map(|(p, n)| p + n)
                        .collect();
                    let t = entropy_threshold(&both, 128) as f32 * self.bin_width();
                    Range {
                        min: (-t).max(seen.min),
                        max: t.min(seen.max),
                    }
                }
            }
        }
    }
}

/// The number of bins, from `levels` up, whose clip of `hist` (everything beyond folded
/// into the last bin) quantized to `levels` levels diverges least from the clip itself.
fn entropy_threshold(hist: &[u64], levels: usize) -> usize {
    let last_nonzero = hist.iter().rposition(|&c| c > 0).map_or(0, |i| i + 1);
    if last_nonzero <= levels {
        return last_nonzero.max(1);
    }
    let mut best = (f64::INFINITY, last_nonzero);
    // Every 8th candidate: the divergence is smooth in the clip, and this is 8x cheaper.
    for bins in (levels..=last_nonzero).step_by(8) {
        let mut p: Vec<f64> = hist[..bins].iter().map(|&c| c as f64).collect();
        let outliers: u64 = hist[bins..].iter().sum();
        p[bins - 1] += outliers as f64;
        // Q: P's first `bins` bins merged into `levels`, each level's count spread over
        // the bins it merged that were not empty.
        let mut q = vec![0f64; bins];
        for level in 0..levels {
            let start = level * bins / levels;
            let end = ((level + 1) * bins / levels).max(start + 1);
            let merged: f64 = hist[start..end].iter().map(|&c| c as f64).sum();
            let nonzero = hist[start..end].iter().filter(|&&c| c > 0).count();
            if nonzero > 0 {
                for (qi, &c) in q[start..end].iter_mut().zip(&hist[start..end]) {
                    if c > 0 {
                        *qi = merged / nonzero as f64;
                    }
                }
            }
        }
        let p_sum: f64 = p.iter().sum();
        let q_sum: f64 = q.iter().sum();
        if p_sum == 0.0 || q_sum == 0.0 {
            continue;
        }
        let mut kl = 0.0;
        for (&pi, &qi) in p.iter().zip(&q) {
            if pi > 0.0 {
                let pn = pi / p_sum;
                // A bin P has and Q lost (the folded outliers): a small floor, not infinity.
                let qn = (qi / q_sum).max(1e-12);
                kl += pn * (pn / qn).ln();
            }
        }
        if kl < best.0 {
            best = (kl, bins);
        }
    }
    best.1
}

/// 8-bit affine parameters for a range: `real = scale * (q - zero_point)`, q in 0..=255.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct U8Params {
    pub scale: f32,
    pub zero_point: u8,
}

impl U8Params {
    pub fn of(range: Range) -> Self {
        let r = range.with_zero();
        let span = r.max - r.min;
        if span <= f32::MIN_POSITIVE {
            return Self {
                scale: 1.0,
                zero_point: 0,
            };
        }
        let scale = span / 255.0;
        let zero_point = (-r.min / scale).round().clamp(0.0, 255.0) as u8;
        Self { scale, zero_point }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relu_range_starts_at_zero_with_zero_point_zero() {
        let mut r = Range::EMPTY;
        r.observe(&[0.0, 1.5, 3.0]);
        let p = U8Params::of(r);
        assert_eq!(p.zero_point, 0);
        assert!((p.scale - 3.0 / 255.0).abs() < 1e-7);
    }

    #[test]
    fn percentile_and_entropy_clip_a_lone_outlier_and_minmax_keeps_it() {
        // A smooth body in [0, 1) and one outlier at 8 (the entropy search's least clip
        // is 256 of the 2048 bins, an eighth of the range).
        let mut values: Vec<f32> = (0..100_000)
            .map(|i| (i as f32 / 100_000.0).powi(2))
            .collect();
        values.push(8.0);
        let mut seen = Range::EMPTY;
        seen.observe(&values);
        let mut h = Histogram::new(seen);
        h.observe(&values);
        assert_eq!(h.range(Method::MinMax, seen).max, 8.0);
        let p = h.range(Method::Percentile, seen);
        assert!(p.max < 1.1, "percentile kept the outlier: {p:?}");
        let e = h.range(Method::Entropy, seen);
        assert!(e.max < 2.0, "entropy kept the outlier: {e:?}");
        assert!(e.max > 0.5, "entropy clipped the body: {e:?}");
    }

    #[test]
    fn negative_values_get_a_zero_point_inside_the_range() {
        let mut r = Range::EMPTY;
        r.observe(&[-1.0, 3.0]);
        let p = U8Params::of(r);
        assert_eq!(p.zero_point, 64);
    }
}
