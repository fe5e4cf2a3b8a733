//! Resample masks and trimaps between the model's resolution and the source image's:
//! bilinear for continuous masks (PIL's mode-"F" BILINEAR), nearest for trimaps, whose
//! three values must stay three values.

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{PixelType, Resizer};
use image::GrayImage;

use super::plane::Plane;
use super::preprocess::bilinear;

/// Bilinear (antialiased when shrinking) resize of a plane.
pub fn resize_plane(
    resizer: &mut Resizer,
    src: &Plane,
    width: u32,
    height: u32,
) -> Result<Plane, String> {
    let mut out = vec![0f32; width as usize * height as usize];
    let src_view = ImageRef::new(
        src.width,
        src.height,
        bytemuck::cast_slice(&src.data),
        PixelType::F32,
    )
    .map_err(|e| e.to_string())?;
    let mut dst = Image::from_slice_u8(
        width,
        height,
        bytemuck::cast_slice_mut(&mut out),
        PixelType::F32,
    )
    .map_err(|e| e.to_string())?;
    resizer
        .resize(&src_view, &mut dst, &bilinear())
        .map_err(|e| e.to_string())?;
    Ok(Plane::new(width, height, out))
}

/// Nearest-neighbour resize as PIL's NEAREST does it: the source coordinate starts at
/// `0.5 * src / dst` and steps by `src / dst` in f64, truncated at each pixel. (The
/// running sum, not `floor((x + 0.5) * src / dst)`: they differ at exact ties.)
pub fn resize_nearest(src: &GrayImage, width: u32, height: u32) -> GrayImage {
    let index = |dst: u32, src: u32| -> Vec<usize> {
        let step = f64::from(src) / f64::from(dst);
        let mut at = 0.5 * step;
        (0..dst)
            .map(|_| {
                let i = (at as usize).min(src as usize - 1);
                at += step;
                i
            })
            .collect()
    };
    let xs = index(width, src.width());
    let ys = index(height, src.height());
    let raw = src.as_raw();
    let sw = src.width() as usize;
    let mut out = Vec::with_capacity(width as usize * height as usize);
    for &y in &ys {
        let row = &raw[y * sw..(y + 1) * sw];
        out.extend(xs.iter().map(|&x| row[x]));
    }
    GrayImage::from_raw(width, height, out).expect("length is width * height")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_keeps_values_and_blocks() {
        // Source x = 0.2, 0.6, 1.0, 1.4, 1.8, truncated.
        let src = GrayImage::from_raw(2, 1, vec![0, 255]).unwrap();
        let out = resize_nearest(&src, 5, 2);
        assert_eq!(
            out.as_raw(),
            &vec![0, 0, 255, 255, 255, 0, 0, 255, 255, 255]
        );
    }

    #[test]
    fn bilinear_plane_of_constant_is_constant() {
        let src = Plane::filled(10, 10, 0.25);
        let out = resize_plane(&mut Resizer::new(), &src, 33, 7).unwrap();
        assert!(out.data.iter().all(|v| (v - 0.25).abs() < 1e-6));
    }

    #[test]
    fn bilinear_upscale_interpolates_between_samples() {
        let src = Plane::new(2, 1, vec![0.0, 1.0]);
        let out = resize_plane(&mut Resizer::new(), &src, 4, 1).unwrap();
        // PIL: centres at 0.25, 0.75, 1.25, 1.75 source px -> 0, 0.25, 0.75, 1.
        let want = [0.0, 0.25, 0.75, 1.0];
        for (o, w) in out.data.iter().zip(want) {
            assert!((o - w).abs() < 1e-6, "{:?}", out.data);
        }
    }
}
