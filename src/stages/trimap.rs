//! Trimap: the segmentation output turned into certain background (0), certain
//! foreground (255) and unknown (128), at the segmentation output's resolution. Both
//! mask kinds end here: a probability is thresholded, class scores are argmaxed and
//! mapped. Erosion then widens the unknown band that matting resolves.

use image::GrayImage;

use super::plane::Plane;
use super::StageError;
use crate::tensor::Tensor;

pub const BACKGROUND: u8 = 0;
pub const UNKNOWN: u8 = 128;
pub const FOREGROUND: u8 = 255;

/// The coarse mask in [0, 1] from channel 0 of a `[1, 1, h, w]` probability output.
/// `minmax` rescales it per image to span [0, 1], as rembg does for the U2Net family.
pub fn probability_mask(out: &Tensor, minmax: bool) -> Result<Plane, StageError> {
    let (h, w) = spatial(out)?;
    let mut data = out.data[..h * w].to_vec();
    if minmax {
        let (lo, hi) = data
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        if hi > lo {
            let span = hi - lo;
            data.iter_mut().for_each(|v| *v = (*v - lo) / span);
        }
    }
    data.iter_mut().for_each(|v| *v = v.clamp(0.0, 1.0));
    Ok(Plane::new(w as u32, h as u32, data))
}

/// Threshold a probability into a trimap.
pub fn threshold(mask: &Plane, foreground: f32, background: f32) -> GrayImage {
    let data = mask
        .data
        .iter()
        .map(|&p| {
            if p >= foreground {
                FOREGROUND
            } else if p <= background {
                BACKGROUND
            } else {
                UNKNOWN
            }
        })
        .collect();
    GrayImage::from_raw(mask.width, mask.height, data).expect("length is width * height")
}

/// Argmax over the class axis of a `[1, C, h, w]` score output (ties go to the lower
/// class), each class mapped to its trimap value. Returns the trimap and the coarse mask
/// (trimap / 255), which the guided filter refines.
pub fn classes(out: &Tensor, class_values: &[u8]) -> Result<(GrayImage, Plane), StageError> {
    let (h, w) = spatial(out)?;
    let n = out.shape[1];
    if n != class_values.len() {
        return Err(StageError::Classes {
            outputs: n,
            mapped: class_values.len(),
        });
    }
    let plane = h * w;
    let mut best = vec![0u8; plane];
    let mut best_score = out.data[..plane].to_vec();
    for c in 1..n {
        let scores = &out.data[c * plane..(c + 1) * plane];
        for ((b, s), &v) in best.iter_mut().zip(best_score.iter_mut()).zip(scores) {
            if v > *s {
                *s = v;
                *b = c as u8;
            }
        }
    }
    let trimap: Vec<u8> = best.iter().map(|&c| class_values[c as usize]).collect();
    let coarse = trimap.iter().map(|&v| f32::from(v) / 255.0).collect();
    Ok((
        GrayImage::from_raw(w as u32, h as u32, trimap).expect("length is width * height"),
        Plane::new(w as u32, h as u32, coarse),
    ))
}

/// Erodes the certain regions by `radius` pixels: a certain pixel stays certain only if
/// every pixel of its (2r+1)^2 window, clipped to the image, has its value.
pub fn erode(trimap: &mut GrayImage, radius: u32) {
    if radius == 0 {
        return;
    }
    let (w, h) = (trimap.width() as usize, trimap.height() as usize);
    let r = radius as usize;
    for value in [FOREGROUND, BACKGROUND] {
        // Separable: "whole window is `value`" is a min over rows, then over columns.
        let is: Vec<u8> = trimap
            .as_raw()
            .iter()
            .map(|&v| u8::from(v == value))
            .collect();
        let rows = window_all(&is, w, h, r, 1, w);
        let kept = window_all(&rows, h, w, r, w, 1);
        for (px, keep) in trimap.iter_mut().zip(kept) {
            if *px == value && keep == 0 {
                *px = UNKNOWN;
            }
        }
    }
}

/// For each line of `len` samples (step `step`, lines `line_step` apart), 1 where every
/// sample within `r` along the line is 1.
fn window_all(
    src: &[u8],
    len: usize,
    lines: usize,
    r: usize,
    step: usize,
    line_step: usize,
) -> Vec<u8> {
    let mut out = vec![0u8; src.len()];
    for line in 0..lines {
        let base = line * line_step;
        // Count zeros in the window; the window is all ones when the count is 0.
        let at = |i: usize| src[base + i * step];
        let mut zeros = (0..=r.min(len - 1)).filter(|&i| at(i) == 0).count();
        for i in 0..len {
            out[base + i * step] = u8::from(zeros == 0);
            if i + r + 1 < len && at(i + r + 1) == 0 {
                zeros += 1;
            }
            if i >= r && at(i - r) == 0 {
                zeros -= 1;
            }
        }
    }
    out
}

fn spatial(out: &Tensor) -> Result<(usize, usize), StageError> {
    match out.shape.as_slice() {
        [1, c, h, w] if *c >= 1 && out.data.len() == c * h * w => Ok((*h, *w)),
        shape => Err(StageError::OutputShape(shape.to_vec())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_splits_three_ways() {
        let mask = Plane::new(4, 1, vec![0.0, 0.04, 0.5, 0.95]);
        let t = threshold(&mask, 0.94, 0.04);
        assert_eq!(t.as_raw(), &vec![0, 0, 128, 255]);
    }

    #[test]
    fn minmax_rescales_to_unit_range() {
        let out = Tensor {
            shape: vec![1, 1, 1, 3],
            data: vec![0.2, 0.4, 0.6],
        };
        let p = probability_mask(&out, true).unwrap();
        assert!((p.data[1] - 0.5).abs() < 1e-6 && p.data[0] == 0.0 && p.data[2] == 1.0);
    }

    #[test]
    fn argmax_maps_classes_like_the_handler() {
        // Two pixels, three classes: pixel 0 -> class 2, pixel 1 -> class 1 (tie 1 vs 2 -> 1).
        let out = Tensor {
            shape: vec![1, 3, 1, 2],
            data: vec![0.0, 0.0, 0.1, 0.5, 0.9, 0.5],
        };
        let (t, coarse) = classes(&out, &[0, 128, 255]).unwrap();
        assert_eq!(t.as_raw(), &vec![255, 128]);
        assert_eq!(coarse.data, vec![1.0, 128.0 / 255.0]);
    }

    #[test]
    fn class_count_must_match_description() {
        let out = Tensor {
            shape: vec![1, 2, 1, 1],
            data: vec![0.0, 1.0],
        };
        assert!(classes(&out, &[0, 128, 255]).is_err());
    }

    #[test]
    fn erosion_opens_a_band_at_the_boundary() {
        // 7 wide: background | foreground at x >= 3.
        let row = [0u8, 0, 0, 255, 255, 255, 255];
        let data: Vec<u8> = row.iter().cycle().take(7 * 3).copied().collect();
        let mut t = GrayImage::from_raw(7, 3, data).unwrap();
        erode(&mut t, 1);
        for y in 0..3 {
            let line: Vec<u8> = (0..7).map(|x| t.get_pixel(x, y)[0]).collect();
            assert_eq!(line, vec![0, 0, 128, 128, 255, 255, 255]);
        }
    }

    #[test]
    fn erosion_ignores_the_outside_of_the_image() {
        let mut t = GrayImage::from_pixel(3, 3, image::Luma([255]));
        erode(&mut t, 2);
        assert!(t.iter().all(|&v| v == 255));
    }
}
