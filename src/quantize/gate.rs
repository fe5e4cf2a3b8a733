//! The quality gate: the whole pipeline's alpha with a reduced-precision model against
//! its alpha with the FP32 model, image by image. Two figures, both at the image's own
//! size: the IoU of the foreground (alpha > 127) and the mean absolute alpha difference
//! in 1/255 steps. A variant passes when every judged image, and all pixels together, are
//! within both limits.
//!
//! An image is judged on its own only when FP32 agrees with itself there: the FP32 alpha
//! of the image with every pixel value moved by at most one level (an invisible change)
//! must be within the limits of the FP32 alpha of the image itself. On an image where it
//! is not (a thin object, an ambiguous subject), no variant can be told good from bad, so
//! that image counts in the overall figures only, and the table says so.

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
    /// FP32 against itself on the image moved by one level (the module header); absent
    /// for the overall row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_noise_floor: Option<NoiseFloor>,
    /// Whether the per-image limits apply to it.
    pub judged: bool,
}

/// FP32's own disagreement on an image under a one-level change of its pixels.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NoiseFloor {
    pub iou: f64,
    pub mean_abs_diff: f64,
}

/// One image to judge: its name, FP32's alpha, the variant's, and FP32's noise floor on
/// it (`None`: judged on its own regardless).
pub struct Judged<'a> {
    pub name: &'a str,
    pub reference: &'a GrayImage,
    pub variant: &'a GrayImage,
    pub noise_floor: Option<NoiseFloor>,
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
            fp32_noise_floor: None,
            judged: true,
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
        self.within(f.iou, f.mean_abs_diff)
    }

    /// Whether FP32 agrees with itself within these limits on an image with this noise
    /// floor: whether the image is judged on its own.
    pub fn admits(&self, floor: &NoiseFloor) -> bool {
        self.within(floor.iou, floor.mean_abs_diff)
    }

    fn within(&self, iou: f64, mean_abs_diff: f64) -> bool {
        iou >= self.min_iou && mean_abs_diff <= self.max_mean_abs_diff
    }

    /// FP32's noise floor on an image: its alpha against the alpha of the same image
    /// moved by one level.
    pub fn noise_floor(reference: &GrayImage, moved: &GrayImage) -> NoiseFloor {
        let f = Tally::of(reference, moved).figures("");
        NoiseFloor {
            iou: f.iou,
            mean_abs_diff: f.mean_abs_diff,
        }
    }

    /// The figures of `images` against this gate.
    pub fn judge<'a>(&self, images: impl IntoIterator<Item = Judged<'a>>) -> GateReport {
        let mut all = Tally::default();
        let mut figures = Vec::new();
        for im in images {
            let t = Tally::of(im.reference, im.variant);
            all.add(t);
            let mut f = t.figures(im.name);
            f.fp32_noise_floor = im.noise_floor;
            f.judged = im.noise_floor.is_none_or(|n| self.admits(&n));
            figures.push(f);
        }
        let overall = all.figures("all");
        let passed = !figures.is_empty()
            && figures.iter().all(|f| !f.judged || self.passes(f))
            && self.passes(&overall);
        GateReport {
            gate: *self,
            images: figures,
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
            let mark = match (f.judged, self.gate.passes(f), f.fp32_noise_floor) {
                (false, _, Some(n)) => format!(
                    "  overall only: FP32 itself moves IoU {:.4}, {:.3}/255 under one level",
                    n.iou, n.mean_abs_diff
                ),
                (_, true, _) => String::new(),
                _ => "  below the gate".into(),
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
        let one = |name, variant| Judged {
            name,
            reference: &a,
            variant,
            noise_floor: None,
        };
        assert!(gate.judge([one("same", &a)]).passed);
        let b = GrayImage::from_fn(10, 10, |x, _| image::Luma([if x < 3 { 255 } else { 0 }]));
        let r = gate.judge([one("a", &a), one("b", &b)]);
        assert!(!r.passed);
        assert!((r.images[1].iou - 0.6).abs() < 1e-9);
        assert!((r.images[1].mean_abs_diff - 51.0).abs() < 1e-9);
        assert!((r.overall.mean_abs_diff - 25.5).abs() < 1e-9);
    }

    #[test]
    fn an_image_fp32_disagrees_with_itself_on_counts_only_overall() {
        // A large foreground, the same in both; and a two-pixel-wide one the variant
        // halves, on which FP32 itself moves as much under one level.
        let edge = |at| {
            GrayImage::from_fn(100, 10, move |x, _| {
                image::Luma([if x < at { 255 } else { 0 }])
            })
        };
        let a = edge(50);
        let (t, u) = (edge(2), edge(1));
        let gate = Gate::default();
        let unstable = Some(Gate::noise_floor(&t, &u));
        let report = gate.judge([
            Judged {
                name: "big",
                reference: &a,
                variant: &a,
                noise_floor: None,
            },
            Judged {
                name: "thin",
                reference: &t,
                variant: &u,
                noise_floor: unstable,
            },
        ]);
        assert!(!report.images[1].judged);
        assert!(report.passed, "{}", report.table());
        // The same thin image, stable in FP32: judged, and below the gate.
        let stable = Some(Gate::noise_floor(&t, &t));
        let report = gate.judge([Judged {
            name: "thin",
            reference: &t,
            variant: &u,
            noise_floor: stable,
        }]);
        assert!(report.images[0].judged);
        assert!(!report.passed);
    }
}
