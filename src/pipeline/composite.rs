//! Composite: the matting result quantised to u8 alpha, and the cut-out (source RGB with
//! that alpha, straight, not premultiplied).

use image::{GrayImage, RgbImage, RgbaImage};

use super::plane::Plane;
use super::trimap::{BACKGROUND, FOREGROUND};

/// Alpha in u8: 255 where the trimap is certain foreground, 0 where certain background,
/// the refined value elsewhere. `trimap` is `None` when the matting stage's alpha is
/// taken as it is (a matting model).
pub fn quantize_alpha(refined: &Plane, trimap: Option<&GrayImage>) -> GrayImage {
    let to_u8 = |v: f32| (v.clamp(0.0, 1.0) * 255.0).round() as u8;
    let data = match trimap {
        Some(t) => refined
            .data
            .iter()
            .zip(t.as_raw())
            .map(|(&v, &t)| match t {
                FOREGROUND => 255,
                BACKGROUND => 0,
                _ => to_u8(v),
            })
            .collect(),
        None => refined.data.iter().map(|&v| to_u8(v)).collect(),
    };
    GrayImage::from_raw(refined.width, refined.height, data).expect("length is width * height")
}

/// RGBA cut-out: the source pixels with `alpha`.
pub fn cutout(rgb: &RgbImage, alpha: &GrayImage) -> RgbaImage {
    let mut out = vec![0u8; rgb.as_raw().len() / 3 * 4];
    for ((dst, px), &a) in out
        .chunks_exact_mut(4)
        .zip(rgb.as_raw().chunks_exact(3))
        .zip(alpha.as_raw())
    {
        dst.copy_from_slice(&[px[0], px[1], px[2], a]);
    }
    RgbaImage::from_raw(rgb.width(), rgb.height(), out).expect("length is 4 * width * height")
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::Rgb;

    #[test]
    fn trimap_certainties_override_the_refinement() {
        let refined = Plane::new(3, 1, vec![0.2, 0.5, 1.3]);
        let trimap = GrayImage::from_raw(3, 1, vec![255, 128, 0]).unwrap();
        let a = quantize_alpha(&refined, Some(&trimap));
        assert_eq!(a.as_raw(), &vec![255, 128, 0]);
        assert_eq!(quantize_alpha(&refined, None).as_raw(), &vec![51, 128, 255]);
    }

    #[test]
    fn cutout_carries_source_and_alpha_exactly() {
        let rgb = RgbImage::from_pixel(2, 1, Rgb([1, 2, 3]));
        let alpha = GrayImage::from_raw(2, 1, vec![0, 200]).unwrap();
        assert_eq!(
            cutout(&rgb, &alpha).as_raw(),
            &vec![1, 2, 3, 0, 1, 2, 3, 200]
        );
    }
}
