//! Decode: request bytes to upright RGB8. Dimensions are checked against the limits from
//! the header, before a single pixel is decoded, so a decompression bomb never
//! allocates. EXIF orientation is honoured; grayscale, CMYK, 16-bit and alpha inputs all
//! end as RGB8 (alpha is dropped: the pipeline computes its own).
//!
//! `decode_into` writes the pixels where a request's allocator says (a GPU server's
//! page-locked blocks, which the GPU uploads from as they are): straight from the decoder
//! for JPEG and 8-bit RGB stored upright, the common case. The others are made RGB8 and
//! upright on the heap, and stay there (the driver stages their upload).

use std::io::Cursor;
use std::path::{Path, PathBuf};

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, RgbImage};

use crate::pixels::{self, HostAlloc, RgbPixels};
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

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
    #[error("the image data is corrupt: {0}")]
    Corrupt(String),
    #[error("the image data is truncated: {0}")]
    Truncated(String),
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

/// How much of an image `dimensions` reads: its headers (a JPEG's EXIF and ICC segments
/// are at most 64 KiB each), not its pixels.
const HEADER_BYTES: usize = 256 << 10;

/// The image's width and height from its header alone, without decoding its pixels
/// (`None` where the header does not say them within its first `HEADER_BYTES`: the decode
/// then says why, or prices it). Upright or not, the pixel count is the same. Only the
/// prefix is handed to the decoder: the JPEG decoder copies whatever it is given before
/// it reads a header, which for a 12 MP photo was its whole body, on the request path.
pub fn dimensions(bytes: &[u8]) -> Option<(u32, u32)> {
    let header = &bytes[..bytes.len().min(HEADER_BYTES)];
    ImageReader::new(Cursor::new(header))
        .with_guessed_format()
        .ok()?
        .into_dimensions()
        .ok()
}

/// Decodes `bytes` to RGB8, upright, on the heap.
pub fn decode(bytes: &[u8], limits: &DecodeLimits) -> Result<RgbImage, DecodeError> {
    decode_into(bytes, limits, &pixels::Heap).map(pixels::into_image)
}

/// Decodes `bytes` to RGB8, upright, into bytes from `alloc`.
pub fn decode_into(
    bytes: &[u8],
    limits: &DecodeLimits,
    alloc: &dyn HostAlloc,
) -> Result<RgbPixels, DecodeError> {
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
    let mut decoder = reader.into_decoder().map_err(|e| match corrupt(e) {
        // A JPEG cut inside its header segments: the header reader says only that bytes
        // are missing, in words of its own.
        DecodeError::Corrupt(text) if format == ImageFormat::Jpeg && jpeg_ends_early(bytes) => {
            DecodeError::Truncated(text)
        }
        other => other,
    })?;
    let (width, height) = decoder.dimensions();
    check_size(width, height, limits)?;
    // A missing or unreadable orientation tag means "as stored".
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    if format == ImageFormat::WebP && riff_ends_early(bytes) {
        return Err(DecodeError::Truncated(
            "the WebP file is shorter than its RIFF header says".into(),
        ));
    }
    let upright = orientation == image::metadata::Orientation::NoTransforms;
    let mut image = match format {
        // The `image` crate decodes JPEG leniently: missing data becomes grey rows.
        ImageFormat::Jpeg => {
            drop(decoder);
            match jpeg_strict(bytes, upright.then_some(alloc))? {
                Jpeg::Rgb(pixels) => return Ok(pixels),
                Jpeg::Other(image) => image,
            }
        }
        _ if upright && decoder.color_type() == image::ColorType::Rgb8 => {
            let len = usize::try_from(decoder.total_bytes()).map_err(|_| {
                DecodeError::Corrupt("the image is larger than this machine's memory".into())
            })?;
            let mut out = alloc.alloc(len);
            decoder.read_image(&mut out).map_err(corrupt)?;
            return rgb_pixels(width, height, out);
        }
        _ => DynamicImage::from_decoder(decoder).map_err(corrupt)?,
    };
    image.apply_orientation(orientation);
    Ok(pixels::from_image(match image {
        DynamicImage::ImageRgb8(rgb) => rgb,
        other => other.into_rgb8(),
    }))
}

/// The file extensions of the formats `decode` reads, for tools that take folders.
pub const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif"];

/// The image files directly in `dir` (by extension, any case), sorted by name.
pub fn image_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        })
        .collect();
    files.sort();
    Ok(files)
}

fn rgb_pixels(width: u32, height: u32, bytes: pixels::HostBytes) -> Result<RgbPixels, DecodeError> {
    RgbPixels::from_raw(width, height, bytes)
        .ok_or_else(|| DecodeError::Corrupt("the decoder returned too few pixels".into()))
}

/// A decoder's refusal: unsupported, truncated (the data ends before the image does:
/// every decoder says so with an end-of-file error) or otherwise corrupt.
fn corrupt(e: image::ImageError) -> DecodeError {
    match e {
        image::ImageError::Unsupported(u) => DecodeError::UnsupportedFormat {
            format: u.to_string(),
        },
        image::ImageError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            DecodeError::Truncated(io.to_string())
        }
        other => {
            let text = other.to_string();
            let lower = text.to_ascii_lowercase();
            if [
                "end of file",
                "unexpected end",
                "unexpected eof",
                "fill whole buffer",
                "not enough bytes",
            ]
            .iter()
            .any(|m| lower.contains(m))
            {
                DecodeError::Truncated(text)
            } else {
                DecodeError::Corrupt(text)
            }
        }
    }
}

/// JPEG through zune-jpeg (the decoder the `image` crate wraps) in strict mode: data that
/// ends early or does not decode is an error instead of grey rows. Gray stays gray (made
/// RGB by the caller); every other colour space (YCbCr, CMYK, YCCK) becomes RGB, straight
/// into bytes from `alloc` when there is one (the image needs no turning).
///
/// A JPEG must reach its end-of-image marker. Without it nothing tells whether the scan
/// data is whole: zune-jpeg, even strict, decodes a scan short of its last bytes by
/// padding the bits, so the last blocks would be made up.
fn jpeg_strict(bytes: &[u8], alloc: Option<&dyn HostAlloc>) -> Result<Jpeg, DecodeError> {
    if jpeg_ends_early(bytes) {
        return Err(DecodeError::Truncated(
            "the JPEG data ends before its end-of-image marker".into(),
        ));
    }
    let refused = |e: zune_jpeg::errors::DecodeErrors| {
        if jpeg_ends_early(bytes) {
            DecodeError::Truncated(format!("the JPEG data ends before its image does ({e})"))
        } else {
            DecodeError::Corrupt(format!("JPEG: {e}"))
        }
    };
    let options = DecoderOptions::default()
        .set_strict_mode(true)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    decoder.decode_headers().map_err(refused)?;
    let gray = matches!(
        decoder.input_colorspace(),
        Some(ColorSpace::Luma | ColorSpace::LumaA)
    );
    let out = if gray {
        ColorSpace::Luma
    } else {
        ColorSpace::RGB
    };
    decoder.set_options(decoder.options().jpeg_set_out_colorspace(out));
    let (width, height) = decoder
        .dimensions()
        .ok_or_else(|| DecodeError::Corrupt("JPEG without dimensions".into()))?;
    let (width, height) = (width as u32, height as u32);
    if let (false, Some(alloc)) = (gray, alloc) {
        let len = decoder
            .output_buffer_size()
            .ok_or_else(|| DecodeError::Corrupt("JPEG without dimensions".into()))?;
        let mut out = alloc.alloc(len);
        decoder.decode_into(&mut out).map_err(refused)?;
        return rgb_pixels(width, height, out).map(Jpeg::Rgb);
    }
    let pixels = decoder.decode().map_err(refused)?;
    let wrong_size = || DecodeError::Corrupt("JPEG: the decoder returned too few pixels".into());
    Ok(Jpeg::Other(if gray {
        DynamicImage::ImageLuma8(
            image::GrayImage::from_raw(width, height, pixels).ok_or_else(wrong_size)?,
        )
    } else {
        DynamicImage::ImageRgb8(RgbImage::from_raw(width, height, pixels).ok_or_else(wrong_size)?)
    }))
}

/// A JPEG decoded: into an allocator's bytes (colour, stored upright), or as an image to
/// be made RGB8 and upright.
enum Jpeg {
    Rgb(RgbPixels),
    Other(DynamicImage),
}

/// Whether JPEG data runs out before its end-of-image marker: the marker segments are
/// walked from the start, skipping each scan's entropy-coded data (where a 0xFF byte is
/// followed by 0x00, a restart marker or more 0xFF), until EOI. A file with bytes after
/// its EOI is complete; one whose segment lengths make no sense is corrupt, not short.
pub fn jpeg_ends_early(bytes: &[u8]) -> bool {
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        return false;
    }
    let len = bytes.len();
    let mut i = 2;
    loop {
        // The next marker, past any junk and fill bytes.
        let Some(ff) = bytes
            .get(i..)
            .and_then(|rest| rest.iter().position(|&b| b == 0xFF))
        else {
            return true;
        };
        i += ff;
        while i < len && bytes[i] == 0xFF {
            i += 1;
        }
        let Some(&marker) = bytes.get(i) else {
            return true;
        };
        i += 1;
        match marker {
            0xD9 => return false,
            0x00 | 0x01 | 0xD0..=0xD8 => continue,
            _ => {}
        }
        let Some(segment) = bytes.get(i..i + 2) else {
            return true;
        };
        let segment = usize::from(u16::from_be_bytes([segment[0], segment[1]]));
        if segment < 2 {
            return false;
        }
        i += segment;
        if i > len {
            return true;
        }
        if marker == 0xDA {
            // Entropy-coded data: up to the first 0xFF that starts a real marker.
            loop {
                let Some(ff) = bytes[i..].iter().position(|&b| b == 0xFF) else {
                    return true;
                };
                i += ff;
                match bytes.get(i + 1) {
                    None => return true,
                    Some(0x00 | 0xD0..=0xD7) => i += 2,
                    Some(0xFF) => i += 1,
                    Some(_) => break,
                }
            }
        }
    }
}

/// Whether a RIFF (WebP) file is shorter than its header's size field says.
fn riff_ends_early(bytes: &[u8]) -> bool {
    match bytes.get(4..8) {
        Some(size) if bytes.starts_with(b"RIFF") => {
            let size = u32::from_le_bytes([size[0], size[1], size[2], size[3]]);
            (bytes.len() as u64) < u64::from(size) + 8
        }
        _ => false,
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
    fn dimensions_come_from_the_header_without_the_pixels() {
        let png = png_of(300, 200);
        assert_eq!(dimensions(&png), Some((300, 200)));
        // Cut inside its pixel data: the header still says the size; the decode fails.
        let cut = &png[..png.len() - 20];
        assert_eq!(dimensions(cut), Some((300, 200)));
        assert!(decode(cut, &DecodeLimits::default()).is_err());
        // A JPEG longer than the header prefix: its size is still read from the prefix.
        let noise = RgbImage::from_fn(1200, 900, |x, y| {
            let v = (x.wrapping_mul(2_654_435_761) ^ y.wrapping_mul(40_503)) as u8;
            Rgb([v, v.rotate_left(3), v.rotate_left(5)])
        });
        let mut jpeg = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 95)
            .encode_image(&noise)
            .unwrap();
        assert!(jpeg.len() > HEADER_BYTES, "{} bytes", jpeg.len());
        assert_eq!(dimensions(&jpeg), Some((1200, 900)));
        assert_eq!(dimensions(b"not an image"), None);
        assert_eq!(dimensions(&[]), None);
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
            Err(DecodeError::Truncated(_))
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

    /// A picture whose every row differs, so that each part of the file carries pixels.
    fn detailed(width: u32, height: u32) -> RgbImage {
        RgbImage::from_fn(width, height, |x, y| {
            Rgb([(x * 2) as u8, (y * 3) as u8, ((x * y) % 251) as u8])
        })
    }

    fn encoded(image: &RgbImage, format: image::ImageFormat) -> Vec<u8> {
        let mut out = Vec::new();
        let dynamic = DynamicImage::ImageRgb8(image.clone());
        let dynamic = if format == image::ImageFormat::Gif {
            DynamicImage::ImageRgba8(dynamic.into_rgba8())
        } else {
            dynamic
        };
        dynamic
            .write_to(&mut Cursor::new(&mut out), format)
            .unwrap();
        out
    }

    /// Every decoder, cut anywhere in its pixel data: refused as truncated, never a
    /// picture with made-up rows (the `image` crate's JPEG path fills them grey).
    #[test]
    fn truncated_data_is_refused_in_every_format() {
        use image::ImageFormat::*;
        let limits = DecodeLimits::default();
        let picture = detailed(96, 64);
        for format in [Jpeg, Png, WebP, Tiff, Gif, Bmp] {
            let full = encoded(&picture, format);
            assert!(decode(&full, &limits).is_ok(), "{format:?} whole");
            let n = full.len();
            // Trailers that hold no pixels (PNG's IEND, GIF's ';' and its last data
            // sub-block's terminator, JPEG's EOI) aside.
            let trailer = match format {
                Png => 12,
                Gif => 2,
                Jpeg => 2,
                _ => 0,
            };
            for cut in [n / 4, n / 2, 3 * n / 4, n * 9 / 10] {
                match decode(&full[..cut], &limits) {
                    Err(DecodeError::Truncated(_)) => {}
                    other => panic!("{format:?} cut at {cut} of {n}: {other:?}"),
                }
            }
            // One byte short of the pixels' end: refused, or every pixel already there
            // (GIF's last LZW byte may hold only its end code).
            let cut = n - trailer - 1;
            match decode(&full[..cut], &limits) {
                Err(DecodeError::Truncated(_)) => {}
                Ok(image) if image == decode(&full, &limits).unwrap() => {}
                other => panic!("{format:?} cut at {cut} of {n}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_jpeg_without_its_end_marker_is_truncated() {
        let jpeg = encoded(&detailed(96, 64), image::ImageFormat::Jpeg);
        assert!(decode(&jpeg, &DecodeLimits::default()).is_ok());
        assert!(!jpeg_ends_early(&jpeg));
        // Bytes after the end marker are not the image's.
        let mut trailing = jpeg.clone();
        trailing.extend_from_slice(b"junk after EOI");
        assert!(!jpeg_ends_early(&trailing));
        assert!(decode(&trailing, &DecodeLimits::default()).is_ok());
        for cut in [2, 3] {
            assert!(jpeg_ends_early(&jpeg[..jpeg.len() - cut]));
            assert!(matches!(
                decode(&jpeg[..jpeg.len() - cut], &DecodeLimits::default()),
                Err(DecodeError::Truncated(_))
            ));
        }
    }

    #[test]
    fn strict_jpeg_decodes_as_the_image_crate_does() {
        let picture = detailed(97, 61);
        for quality in [50, 95] {
            let mut jpeg = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, quality)
                .write_image(picture.as_raw(), 97, 61, image::ExtendedColorType::Rgb8)
                .unwrap();
            let lenient = image::load_from_memory(&jpeg).unwrap().into_rgb8();
            assert_eq!(decode(&jpeg, &DecodeLimits::default()).unwrap(), lenient);
        }
        let gray = image::GrayImage::from_fn(33, 20, |x, y| image::Luma([(x * 7 + y) as u8]));
        let mut jpeg = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 90)
            .write_image(gray.as_raw(), 33, 20, image::ExtendedColorType::L8)
            .unwrap();
        let lenient = image::load_from_memory(&jpeg).unwrap().into_rgb8();
        assert_eq!(decode(&jpeg, &DecodeLimits::default()).unwrap(), lenient);
    }
}
