//! A device's result as the response body the output kind asks for: the RGBA cut-out, the
//! alpha or the trimap as PNG or lossless WebP, or JSON with all three (PNG) and the stage
//! times. Nothing is
//! composited here: a device that was asked for a cut-out (every output that shows one)
//! made it, the GPU before its one download, the CPU on its replica.

use std::time::Instant;

use image::ExtendedColorType;

use super::encode::{self, EncodeError};
use crate::matte::{MattePlanes, MissingPlane, Planes, StageTimings};
use crate::pixels::GrayPixels;
use crate::spec::OutputKind;

/// How an image answer is encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ImageFormat {
    #[default]
    Png,
    /// Lossless WebP (VP8L), alpha included.
    Webp,
}

impl ImageFormat {
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Webp => "image/webp",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Webp => "WebP",
        }
    }

    /// Encodes 8-bit pixels (`color` says which) in this format.
    pub fn encode(
        self,
        pixels: &[u8],
        width: u32,
        height: u32,
        color: ExtendedColorType,
    ) -> Result<Vec<u8>, EncodeError> {
        match self {
            Self::Png => encode::png(pixels, width, height, color),
            Self::Webp => encode::webp(pixels, width, height, color),
        }
    }
}

/// An encoded response body.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

/// Why a result could not be rendered: the server's fault, never the client's.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("encoding the {what}: {source}")]
    Encode {
        what: &'static str,
        source: EncodeError,
    },
    #[error("encoding the JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the {kind} output: {missing}")]
    Missing {
        kind: &'static str,
        missing: MissingPlane,
    },
}

/// The planes the answer of `kind` shows: all that a device need hand back for it.
pub fn planes_of(kind: OutputKind) -> Planes {
    match kind {
        OutputKind::Cutout => Planes::CUTOUT,
        OutputKind::Alpha => Planes::ALPHA,
        OutputKind::Trimap => Planes {
            trimap: true,
            ..Planes::default()
        },
        OutputKind::Json => Planes::ALL,
    }
}

/// Encodes the device's `planes` (those of `planes_of(kind)`) as `kind`, images as PNG.
/// JSON carries every PNG (base64) and the timings, which is why `timings.encode` is set
/// before the JSON is written.
pub fn render(
    planes: &MattePlanes,
    kind: OutputKind,
    timings: &mut StageTimings,
) -> Result<Rendered, RenderError> {
    render_as(planes, kind, ImageFormat::Png, timings)
}

/// As `render`, the cut-out, alpha or trimap in `format` (JSON's images stay PNG).
pub fn render_as(
    planes: &MattePlanes,
    kind: OutputKind,
    format: ImageFormat,
    timings: &mut StageTimings,
) -> Result<Rendered, RenderError> {
    let (w, h) = planes.dimensions();
    let missing = |missing| RenderError::Missing {
        kind: kind.name(),
        missing,
    };
    let encode_as = |format: ImageFormat, what: &'static str, pixels: &[u8], color| {
        format
            .encode(pixels, w, h, color)
            .map_err(|source| RenderError::Encode { what, source })
    };
    let png = |what, pixels: &[u8], color| encode_as(ImageFormat::Png, what, pixels, color);
    let gray = |what, g: &GrayPixels| png(what, g.as_raw(), ExtendedColorType::L8);
    let cutout = || planes.cutout().map_err(missing);
    let alpha = || planes.alpha().map_err(missing);
    let trimap = || planes.trimap().map_err(missing);
    let t = Instant::now();
    let (content_type, body) = match kind {
        OutputKind::Cutout => (
            format.content_type(),
            encode_as(
                format,
                "cut-out",
                cutout()?.as_raw(),
                ExtendedColorType::Rgba8,
            )?,
        ),
        OutputKind::Alpha => (
            format.content_type(),
            encode_as(format, "alpha", alpha()?.as_raw(), ExtendedColorType::L8)?,
        ),
        OutputKind::Trimap => (
            format.content_type(),
            encode_as(format, "trimap", trimap()?.as_raw(), ExtendedColorType::L8)?,
        ),
        OutputKind::Json => {
            use base64::Engine;
            let b64 = |bytes: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(bytes);
            let cutout_png = png("cut-out", cutout()?.as_raw(), ExtendedColorType::Rgba8)?;
            let alpha = gray("alpha", alpha()?)?;
            let trimap = gray("trimap", trimap()?)?;
            timings.encode = t.elapsed();
            let body = serde_json::to_vec(&serde_json::json!({
                "width": w,
                "height": h,
                "cutout_png": b64(cutout_png),
                "alpha_png": b64(alpha),
                "trimap_png": b64(trimap),
                "timings_ms": timings,
            }))?;
            return Ok(Rendered {
                content_type: "application/json",
                body,
            });
        }
    };
    timings.encode = t.elapsed();
    Ok(Rendered { content_type, body })
}
