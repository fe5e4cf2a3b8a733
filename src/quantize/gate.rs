//! The quality gate: the whole pipeline's alpha with a reduced-precision model against
//! its alpha with the FP32 model, image by image. Two figures, both at the image's own
//! size: the IoU of the foreground (alpha > 127) and the mean absolute alpha difference
//! in 1/255 steps. A variant passes when every image, and all pixels together, are
//! within both limits.

use image::GrayImage;
use serde::{Deserialize, Serialize};

/// The limits a variant must meet.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gate {
    /// Least IoU of alpha > 127 (default 0.98).
    pub min_iou: f64,
    /// Largest mean |alpha difference|, in 1/255 steps (default 2).
    pub max_mean_abs_diff: f64,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            min_iou: 0.98,
            max_mean_abs_diff: 2.0,
        }
    }
}

/// One image's figures (or all images' together).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    pub image: String,
    pub iou: f64,
    /// Mean |alpha difference| in 1/255 steps.
    pub mean_abs_diff: f64,
    /// The largest difference at any pixel, in 1/255 steps.
    pub max_abs_diff: u8,
}

/// What the gate measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GateReport {
    pub gate: Gate,
    pub images: Vec<Figures>,
    pub overall: Figures,
    pub passed: bool,
}

/// Sums over pixels, so that images add up to the overall figures.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    intersection: u64,
    union: u64,
    abs_diff: u64,
    pixels: u64,
    max: u8,
}

impl Tally {
    fn of(reference: &GrayImage, variant: &GrayImage) -> Self {
        let mut t = Tally::default();
        for (&a, &b) in reference.as_raw().iter().zip(variant.as_raw()) {
            let (fa, fb) = (a > 127, b > 127);
            t.intersection += u64::from(fa && fb);
            t.union += u64::from(fa || fb);
            let d = a.abs_diff(b);
            t.abs_diff += u64::from(d);
            t.max = t.max.max(d);
        }
        t.pixels = reference.as_raw().len() as u64;
        t
    }

    fn add(&mut self, o: Tally) {
        self.intersection += o.intersection;
        self.union += o.union;
        self.abs_diff += o.abs_diff;
        self.pixels += o.pixels;
        self.max = self.max.max(o.max);
    }

    fn figures(&self, image: &str) -> Figures {
        Figures {
            image: image.to_string(),
            // No foreground in either: they agree.
            iou: if self.union == 0 {
                1.0
            } else {
                self.intersection as f64 / self.union as f64
            },
            mean_abs_diff: self.abs_diff as f64 / self.pixels.max(1) as f64,
            max_abs_diff: self.max,
        }
    }
}

impl Gate {
    pub fn passes(&self, f: &Figures) -> bool {
        f.iou >= self.min_iou && f.mean_abs_diff <= self.max_mean_abs_diff
    }

    /// The figures of `pairs` (name, FP32 alpha, variant alpha) against this gate.
    pub fn judge<'a>(
        &self,
        pairs: impl IntoIterator<Item = (&'a str, &'a GrayImage, &'a GrayImage)>,
    ) -> GateReport {
        let mut all = Tally::default();
        let mut images = Vec::new();
        for (name, reference, variant) in pairs {
            let t = Tally::of(reference, variant);
            all.add(t);
            images.push(t.figures(name));
        }
        let overall = all.figures("all");
        let passed =
            !images.is_empty() && images.iter().all(|f| self.passes(f)) && self.passes(&overall);
        GateReport {
            gate: *self,
            images,
            overall,
            passed,
        }
    }
}

impl GateReport {
    /// The table the build prints.
    pub fn table(&self) -> String {
        let mut out = format!(
            "  {:<28} {:>8} {:>12} {:>10}\n",
            "image", "IoU", "mean |Δα|", "max |Δα|"
        );
        for f in self.images.iter().chain(std::iter::once(&self.overall)) {
            let mark = if self.gate.passes(f) {
                ""
            } else {
                "  below the gate"
            };
            out.push_str(&format!(
                "  {:<28} {:>8.4} {:>8.3}/255 {:>6}/255{mark}\n",
                f.image, f.iou, f.mean_abs_diff, f.max_abs_diff
            ));
        }
        out.push_str(&format!(
            "  gate: IoU >= {} and mean |Δα| <= {}/255: {}\n",
            self.gate.min_iou,
            self.gate.max_mean_abs_diff,
            if self.passed { "passed" } else { "FAILED" }
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_alphas_pass_and_a_flipped_half_fails() {
        let a = GrayImage::from_fn(10, 10, |x, _| image::Luma([if x < 5 { 255 } else { 0 }]));
        let gate = Gate::default();
        assert!(gate.judge([("same", &a, &a)]).passed);
        let b = GrayImage::from_fn(10, 10, |x, _| image::Luma([if x < 3 { 255 } else { 0 }]));
        let r = gate.judge([("a", &a, &a), ("b", &a, &b)]);
        assert!(!r.passed);
        assert!((r.images[1].iou - 0.6).abs() < 1e-9);
        assert!((r.images[1].mean_abs_diff - 51.0).abs() < 1e-9);
        assert!((r.overall.mean_abs_diff - 25.5).abs() < 1e-9);
    }
}
