//! Composite: a matting result quantised to u8 alpha, and the cut-out (source RGB with
//! that alpha, straight, not premultiplied; a fully transparent pixel carries no colour).
//! The guided filter quantises its own alpha (it evaluates only the trimap's unknown band).

use image::{GrayImage, RgbaImage};

use super::plane::Plane;
use super::{Bytes, Gray8, Rgb8};

/// Alpha in u8: a matting result in [0, 1] (clamped), rounded.
pub fn quantize_alpha(refined: &Plane) -> GrayImage {
    let data = refined.data.iter().map(|&v| unit_to_u8(v)).collect();
    GrayImage::from_raw(refined.width, refined.height, data).expect("length is width * height")
}

/// `(v.clamp(0.0, 1.0) * 255.0).round() as u8`, without the call to `roundf` that the
/// baseline x86-64 target makes of `round` (no SSE4.1): a scaled value in [0, 255] is its
/// integer part plus one when the fraction, exact in f32, is at least a half. NaN gives 0,
/// as the cast of `round` does.
pub fn unit_to_u8(v: f32) -> u8 {
    let scaled = v.clamp(0.0, 1.0) * 255.0;
    let whole = scaled as u8;
    whole + u8::from(scaled - f32::from(whole) >= 0.5)
}

/// RGBA cut-out: the source pixels with `alpha`, and RGB 0 where alpha is 0. An invisible
/// pixel's colour shows nowhere, and keeping it made a photo's cut-out PNG twice the size
/// (the background's detail compressed as if it mattered). The GPU's `write_cutout`
/// (src/cuda/kernels/composite.cu) does exactly the same.
pub fn cutout(rgb: &Rgb8<impl Bytes>, alpha: &Gray8<impl Bytes>) -> RgbaImage {
    let mut out = vec![0u8; rgb.as_raw().len() / 3 * 4];
    for ((dst, px), &a) in out
        .chunks_exact_mut(4)
        .zip(rgb.as_raw().chunks_exact(3))
        .zip(alpha.as_raw().iter())
    {
        if a != 0 {
            dst.copy_from_slice(&[px[0], px[1], px[2], a]);
        }
    }
    RgbaImage::from_raw(rgb.width(), rgb.height(), out).expect("length is 4 * width * height")
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{Rgb, RgbImage};

    /// The reference `unit_to_u8` replaces.
    fn rounded(v: f32) -> u8 {
        (v.clamp(0.0, 1.0) * 255.0).round() as u8
    }

    #[test]
    fn unit_to_u8_is_round_to_the_bit() {
        // Every f32 within 64 ulps of each value that scales to a half (the ties and the
        // values either side), then a sweep of [-0.5, 1.5] and the special values.
        for k in 0..=255u32 {
            let tie = (k as f32 + 0.5) / 255.0;
            for d in -64i32..=64 {
                let v = f32::from_bits(tie.to_bits().wrapping_add_signed(d));
                assert_eq!(unit_to_u8(v), rounded(v), "{v:e}");
            }
        }
        for i in 0..=4_000_000u32 {
            let v = -0.5 + 2.0 * i as f32 / 4_000_000.0;
            assert_eq!(unit_to_u8(v), rounded(v), "{v:e}");
        }
        for v in [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            f32::MIN_POSITIVE,
        ] {
            assert_eq!(unit_to_u8(v), rounded(v), "{v:e}");
        }
    }

    #[test]
    fn quantize_clamps_and_rounds() {
        let refined = Plane::new(4, 1, vec![-0.2, 0.2, 0.5, 1.3]);
        assert_eq!(quantize_alpha(&refined).as_raw(), &vec![0, 51, 128, 255]);
    }

    #[test]
    fn cutout_carries_source_and_alpha_exactly_and_no_colour_where_invisible() {
        let rgb = RgbImage::from_pixel(3, 1, Rgb([1, 2, 3]));
        let alpha = GrayImage::from_raw(3, 1, vec![0, 1, 200]).unwrap();
        assert_eq!(
            cutout(&rgb, &alpha).as_raw(),
            &vec![0, 0, 0, 0, 1, 2, 3, 1, 1, 2, 3, 200]
        );
    }
}
