//! Resample masks and trimaps between the model's resolution and the source image's:
//! bilinear for continuous masks (PIL's mode-"F" BILINEAR), nearest for trimaps, whose
//! three values must stay three values.

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{PixelType, Resizer};
use image::GrayImage;

use super::plane::Plane;
use super::preprocess::bilinear;
use super::StageError;

/// Bilinear (antialiased when shrinking) resize of a plane.
pub fn resize_plane(
    resizer: &mut Resizer,
    src: &Plane,
    width: u32,
    height: u32,
) -> Result<Plane, StageError> {
    resize_plane_into(resizer, src, width, height, Vec::new())
}

/// `resize_plane` into `out`'s memory (its length made `width * height`).
pub fn resize_plane_into(
    resizer: &mut Resizer,
    src: &Plane,
    width: u32,
    height: u32,
    mut out: Vec<f32>,
) -> Result<Plane, StageError> {
    out.resize(width as usize * height as usize, 0.0);
    let src_view = ImageRef::new(
        src.width,
        src.height,
        bytemuck::cast_slice(&src.data),
        PixelType::F32,
    )?;
    let mut dst = Image::from_slice_u8(
        width,
        height,
        bytemuck::cast_slice_mut(&mut out),
        PixelType::F32,
    )?;
    resizer.resize(&src_view, &mut dst, &bilinear())?;
    Ok(Plane::new(width, height, out))
}

/// Nearest-neighbour resize as PIL's NEAREST does it: the source coordinate starts at
/// `0.5 * src / dst` and steps by `src / dst` in f64, truncated at each pixel. (The
/// running sum, not `floor((x + 0.5) * src / dst)`: they differ at exact ties.)
pub fn resize_nearest(src: &GrayImage, width: u32, height: u32) -> GrayImage {
    let mut out = vec![0u8; width as usize * height as usize];
    resize_nearest_into(src, width, height, &mut out);
    GrayImage::from_raw(width, height, out).expect("length is width * height")
}

/// `resize_nearest` into `out` (`width * height` bytes, each written).
pub fn resize_nearest_into(src: &GrayImage, width: u32, height: u32, out: &mut [u8]) {
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
    let (sw, w) = (src.width() as usize, width as usize);
    // An upscale (a trimap to the source size) repeats source pixels in runs and source
    // rows in runs: each run of a row is a fill, and a row that repeats the one above is
    // a copy of it.
    let runs = runs_of(&xs);
    for (y, &sy) in ys.iter().enumerate() {
        let (above, rest) = out.split_at_mut(y * w);
        let row = &mut rest[..w];
        if y > 0 && ys[y - 1] == sy {
            row.copy_from_slice(&above[(y - 1) * w..]);
            continue;
        }
        let src_row = &raw[sy * sw..(sy + 1) * sw];
        let mut at = 0;
        for &(sx, len) in &runs {
            row[at..at + len].fill(src_row[sx]);
            at += len;
        }
    }
}

/// `indices` as runs of one value: `(value, length)`.
fn runs_of(indices: &[usize]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &i in indices {
        match runs.last_mut() {
            Some((last, len)) if *last == i => *len += 1,
            _ => runs.push((i, 1)),
        }
    }
    runs
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
    fn nearest_is_a_gather_of_each_output_pixel() {
        // Against the definition, pixel by pixel: up, down, both, and 1-pixel edges.
        let src = GrayImage::from_fn(37, 23, |x, y| image::Luma([(x * 7 + y * 13) as u8]));
        for (w, h) in [(1920, 1080), (111, 70), (20, 9), (37, 23), (1, 1), (5, 200)] {
            let out = resize_nearest(&src, w, h);
            // PIL's source coordinates: half a step, then a step at a time, truncated.
            let coords = |dst: u32, src: u32| -> Vec<u32> {
                let step = f64::from(src) / f64::from(dst);
                let mut v = 0.5 * step;
                (0..dst)
                    .map(|_| {
                        let i = (v as u32).min(src - 1);
                        v += step;
                        i
                    })
                    .collect()
            };
            let (sxs, sys) = (coords(w, 37), coords(h, 23));
            for y in 0..h {
                for x in 0..w {
                    let (sx, sy) = (sxs[x as usize], sys[y as usize]);
                    assert_eq!(
                        out.get_pixel(x, y),
                        src.get_pixel(sx, sy),
                        "{w}x{h} at {x},{y}"
                    );
                }
            }
        }
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
