//! Decode: request bytes to upright RGB8. Dimensions are checked against the limits from
//! the header, before a single pixel is decoded, so a decompression bomb never
//! allocates. EXIF orientation is honoured; grayscale, CMYK, 16-bit and alpha inputs all
//! end as RGB8 (alpha is dropped: the pipeline computes its own).

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageReader, RgbImage};

/// What a request image may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Width x height above which an image is refused (default 50 MP).
    pub max_pixels: u64,
    /// Images narrower or shorter than this are refused: there is nothing to matte.
    pub min_side_px: u32,
    /// Images wider or taller than this are refused: a GPU's buffers (resize taps, the
    /// horizontal pass) are sized for it at start-up, so every device accepts the same.
    pub max_side_px: u32,
}

/// The default longest side: beyond any camera's, within what GPU buffers are sized for.
pub const MAX_SIDE_PX: u32 = 16_384;

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_pixels: 50_000_000,
            min_side_px: 8,
            max_side_px: MAX_SIDE_PX,
        }
    }
}

/// Why an image could not be decoded: always the client's input.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("the request body is empty")]
    Empty,
    #[error("the body is not an image in a supported format (JPEG, PNG, WebP, BMP, TIFF, GIF)")]
    UnknownFormat,
    #[error("{format} images are not supported; send JPEG, PNG, WebP, BMP, TIFF or GIF")]
    UnsupportedFormat { format: String },
    #[error("the image is {width}x{height} = {pixels} pixels, over the limit of {limit} pixels")]
    TooManyPixels {
        width: u32,
        height: u32,
        pixels: u64,
        limit: u64,
    },
    #[error("the image is {width}x{height}; the smallest accepted is {min}x{min}")]
    TooSmall { width: u32, height: u32, min: u32 },
    #[error("the image is {width}x{height}; the longest accepted side is {max} pixels")]
    TooLong { width: u32, height: u32, max: u32 },
    #[error("the image data is corrupt or truncated: {0}")]
    Corrupt(String),
}

/// The limits on an image's size, from its width and height alone: checked before a
/// decoder (or a raw tensor's copy) allocates its pixels.
pub fn check_size(width: u32, height: u32, limits: &DecodeLimits) -> Result<(), DecodeError> {
    let pixels = u64::from(width) * u64::from(height);
    if pixels > limits.max_pixels {
        return Err(DecodeError::TooManyPixels {
            width,
            height,
            pixels,
            limit: limits.max_pixels,
        });
    }
    if width.max(height) > limits.max_side_px {
        return Err(DecodeError::TooLong {
            width,
            height,
            max: limits.max_side_px,
        });
    }
    if width < limits.min_side_px || height < limits.min_side_px {
        return Err(DecodeError::TooSmall {
            width,
            height,
            min: limits.min_side_px,
        });
    }
    Ok(())
}

/// Decodes `bytes` to RGB8, upright.
pub fn decode(bytes: &[u8], limits: &DecodeLimits) -> Result<RgbImage, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| DecodeError::Corrupt(e.to_string()))?;
    let Some(format) = reader.format() else {
        return Err(DecodeError::UnknownFormat);
    };
    if !format.reading_enabled() {
        return Err(DecodeError::UnsupportedFormat {
            format: format!("{format:?}"),
        });
    }
    let mut decoder = reader.into_decoder().map_err(corrupt)?;
    let (width, height) = decoder.dimensions();
    check_size(width, height, limits)?;
    // A missing or unreadable orientation tag means "as stored".
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut image = DynamicImage::from_decoder(decoder).map_err(corrupt)?;
    image.apply_orientation(orientation);
    Ok(match image {
        DynamicImage::ImageRgb8(rgb) => rgb,
        other => other.into_rgb8(),
    })
}

fn corrupt(e: image::ImageError) -> DecodeError {
    match e {
        image::ImageError::Unsupported(u) => DecodeError::UnsupportedFormat {
            format: u.to_string(),
        },
        other => DecodeError::Corrupt(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageEncoder, Rgb};

    fn png_of(width: u32, height: u32) -> Vec<u8> {
        let img = RgbImage::from_pixel(width, height, Rgb([10, 20, 30]));
        let mut out = Vec::new();
        image::codecs::png::PngEncoder::new(&mut out)
            .write_image(img.as_raw(), width, height, image::ExtendedColorType::Rgb8)
            .unwrap();
        out
    }

    #[test]
    fn decodes_png_to_rgb8() {
        let img = decode(&png_of(16, 9), &DecodeLimits::default()).unwrap();
        assert_eq!(img.dimensions(), (16, 9));
        assert_eq!(img.get_pixel(3, 3), &Rgb([10, 20, 30]));
    }

    #[test]
    fn gray16_and_alpha_become_rgb8() {
        let gray =
            image::ImageBuffer::<image::Luma<u16>, _>::from_pixel(9, 9, image::Luma([65535]));
        let mut out = Vec::new();
        DynamicImage::ImageLuma16(gray)
            .write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        let img = decode(&out, &DecodeLimits::default()).unwrap();
        assert_eq!(img.get_pixel(0, 0), &Rgb([255, 255, 255]));

        let rgba = image::RgbaImage::from_pixel(9, 9, image::Rgba([1, 2, 3, 0]));
        let mut out = Vec::new();
        DynamicImage::ImageRgba8(rgba)
            .write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        assert_eq!(
            decode(&out, &DecodeLimits::default())
                .unwrap()
                .get_pixel(0, 0),
            &Rgb([1, 2, 3])
        );
    }

    #[test]
    fn refuses_bad_inputs_with_their_reason() {
        let limits = DecodeLimits::default();
        assert_eq!(decode(b"", &limits), Err(DecodeError::Empty));
        assert_eq!(
            decode(b"definitely not an image", &limits),
            Err(DecodeError::UnknownFormat)
        );
        let png = png_of(16, 16);
        assert!(matches!(
            decode(&png[..png.len() / 2], &limits),
            Err(DecodeError::Corrupt(_))
        ));
        assert!(matches!(
            decode(&png_of(1, 1), &limits),
            Err(DecodeError::TooSmall { .. })
        ));
    }

    #[test]
    fn pixel_limit_is_checked_from_the_header() {
        let limits = DecodeLimits {
            max_pixels: 100,
            min_side_px: 1,
            max_side_px: 20,
        };
        assert!(matches!(
            decode(&png_of(11, 10), &limits),
            Err(DecodeError::TooManyPixels { pixels: 110, .. })
        ));
        // Under the pixel limit, over the side limit: a 21 x 2 strip.
        assert_eq!(
            decode(&png_of(21, 2), &limits),
            Err(DecodeError::TooLong {
                width: 21,
                height: 2,
                max: 20
            })
        );
    }
}
