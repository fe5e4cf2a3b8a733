//! The pipeline description as a person reads it (`celer inspect`, the start-up log):
//! what each model takes and gives, how the trimap is made, how matting is done and what
//! a request gets back, in words and numbers, not Rust's `Debug` form.

use std::fmt;
use std::path::Path;

use super::pipeline::{
    ImageInputSpec, MaskKind, MattingSpec, Normalize, OutputKind, PipelineSpec, Scale,
};

/// The model file's name (the description's folder is printed once, above).
fn file(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

fn three(v: [f32; 3]) -> String {
    format!("({}, {}, {})", v[0], v[1], v[2])
}

fn normalisation(n: &Normalize) -> String {
    let scale = match n.scale {
        Scale::ImageMax => "divided by the image's max".to_string(),
        Scale::Fixed(s) if (s - 1.0 / 255.0).abs() < 1e-9 => "divided by 255".to_string(),
        Scale::Fixed(s) => format!("times {s}"),
    };
    format!("{scale}, mean {}, std {}", three(n.mean), three(n.std))
}

fn input(spec: &ImageInputSpec, channels: &str) -> String {
    format!(
        "`{}` {}x{} {channels}, {}",
        spec.input,
        spec.width,
        spec.height,
        normalisation(&spec.normalize)
    )
}

impl fmt::Display for OutputKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OutputKind::Cutout => "cutout (RGBA PNG)",
            OutputKind::Alpha => "alpha (grayscale PNG)",
            OutputKind::Trimap => "trimap (grayscale PNG of 0, 128, 255)",
            OutputKind::Json => "json (every PNG in base64, and the stage times)",
        })
    }
}

impl fmt::Display for PipelineSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seg = &self.segmentation;
        writeln!(f, "pipeline {}", self.source.display())?;
        writeln!(
            f,
            "  segmentation  {}: input {}",
            file(&seg.image.model),
            input(&seg.image, "RGB")
        )?;
        let mask = match &seg.mask {
            MaskKind::Probability { minmax: true } => {
                "a probability, rescaled to [0, 1] per image".to_string()
            }
            MaskKind::Probability { minmax: false } => "a probability".to_string(),
            MaskKind::Classes { class_values } => {
                let values: Vec<String> = class_values
                    .iter()
                    .enumerate()
                    .map(|(c, v)| format!("{c} -> {v}"))
                    .collect();
                format!(
                    "class scores, argmax mapped to the trimap as {}",
                    values.join(", ")
                )
            }
        };
        writeln!(f, "                output `{}`: {mask}", seg.output)?;
        let t = &self.trimap;
        writeln!(
            f,
            "  trimap        foreground at >= {}, background at <= {}, certain regions eroded by {} px",
            t.foreground, t.background, t.erode_px
        )?;
        match &self.matting {
            MattingSpec::GuidedFilter {
                radius_px,
                epsilon,
                subsample,
            } => writeln!(
                f,
                "  matting       guided filter of the mask by the image's luma: radius {radius_px} px, epsilon {epsilon}, fitted at 1/{subsample} of the source size"
            )?,
            MattingSpec::Model {
                image,
                trimap_input,
                output,
            } => {
                writeln!(
                    f,
                    "  matting       {}: input {}",
                    file(&image.model),
                    input(image, "RGB")
                )?;
                writeln!(
                    f,
                    "                input `{trimap_input}` the trimap at that size (value / 255); output `{output}`: alpha, resized to the source"
                )?;
            }
        }
        writeln!(f, "  output        {}", self.default_output)?;
        let b = &self.batching;
        if b.max_batch <= 1 {
            write!(f, "  batching      off")
        } else {
            write!(
                f,
                "  batching      up to {} requests per run, waiting at most {} us for more",
                b.max_batch, b.max_wait_us
            )
        }
    }
}
