//! Encode: PNG with the fast compression level, or lossless WebP. A PNG of a 2 MP cut-out
//! at the default level costs more than the model; the fast level trades ~20 % size for
//! ~5x speed. Lossless WebP (VP8L, the `image` crate's encoder: alpha included) is the
//! compact answer: smaller than that PNG on photographs' cut-outs (docs/hosting.md,
//! "Response formats and sizes").

use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::codecs::webp::WebPEncoder;
use image::{ExtendedColorType, ImageEncoder};

/// Why pixels could not be encoded: the server's fault (it made the pixels), never the
/// client's.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("{len} bytes for a {width}x{height} {color:?} image of {expected}")]
    Length {
        len: usize,
        width: u32,
        height: u32,
        color: ExtendedColorType,
        expected: u64,
    },
    #[error(transparent)]
    Image(#[from] image::ImageError),
}

/// The row filter: "Sub" alone predicts photographs and flat alpha nearly as well as
/// trying all five filters per row ("Adaptive"), at a fifth of the cost.
pub const FILTER: FilterType = FilterType::Sub;

/// Encodes 8-bit pixels (`color` says which) as PNG, with `FILTER` on every row.
pub fn png(
    pixels: &[u8],
    width: u32,
    height: u32,
    color: ExtendedColorType,
) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(pixels.len() / 2);
    PngEncoder::new_with_quality(&mut out, CompressionType::Fast, FILTER)
        .write_image(pixels, width, height, color)?;
    Ok(out)
}

/// Encodes 8-bit pixels (`Rgba8`, `Rgb8`, `L8` or `La8`) as lossless WebP.
pub fn webp(
    pixels: &[u8],
    width: u32,
    height: u32,
    color: ExtendedColorType,
) -> Result<Vec<u8>, EncodeError> {
    // The encoder asserts the length (a panic); say it instead.
    let expected = u64::from(width) * u64::from(height) * u64::from(color.bits_per_pixel()) / 8;
    if pixels.len() as u64 != expected {
        return Err(EncodeError::Length {
            len: pixels.len(),
            width,
            height,
            color,
            expected,
        });
    }
    let mut out = Vec::with_capacity(pixels.len() / 3);
    WebPEncoder::new_lossless(&mut out).encode(pixels, width, height, color)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webp_is_lossless_with_alpha() {
        let rgba: Vec<u8> = (0..4 * 7 * 5).map(|v| (v * 37 % 256) as u8).collect();
        let bytes = webp(&rgba, 7, 5, ExtendedColorType::Rgba8).unwrap();
        assert_eq!(&bytes[..4], b"RIFF");
        assert_eq!(&bytes[8..16], b"WEBPVP8L");
        let back = image::load_from_memory(&bytes).unwrap();
        assert_eq!(back.color(), image::ColorType::Rgba8);
        assert_eq!(back.into_rgba8().as_raw(), &rgba);
        let gray: Vec<u8> = (0..7 * 5).map(|v| v as u8).collect();
        let back = image::load_from_memory(&webp(&gray, 7, 5, ExtendedColorType::L8).unwrap())
            .unwrap()
            .into_luma8();
        assert_eq!(back.as_raw(), &gray);
        assert!(webp(&rgba[1..], 7, 5, ExtendedColorType::Rgba8).is_err());
    }

    #[test]
    fn round_trips_through_the_decoder() {
        let rgba: Vec<u8> = (0..4 * 5 * 3).map(|v| v as u8).collect();
        let bytes = png(&rgba, 5, 3, ExtendedColorType::Rgba8).unwrap();
        let back = image::load_from_memory(&bytes).unwrap().into_rgba8();
        assert_eq!(back.as_raw(), &rgba);
    }
}
