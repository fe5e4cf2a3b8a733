//! Matting by guided filter (He, Sun and Tang, "Guided Image Filtering", 2010/2013): the
//! coarse mask, upsampled to the source size, is filtered with the image's luma as the
//! guide, so the alpha follows the image's edges (hair, fur) instead of the model's
//! 320-pixel grid. Box means run as running sums, O(1) per pixel whatever the radius.

use image::RgbImage;

use super::plane::Plane;

/// Luma in [0, 1] (BT.601 weights), the filter's guide.
pub fn luma(rgb: &RgbImage) -> Plane {
    let data = rgb
        .as_raw()
        .chunks_exact(3)
        .map(|p| {
            (0.299 * f32::from(p[0]) + 0.587 * f32::from(p[1]) + 0.114 * f32::from(p[2])) / 255.0
        })
        .collect();
    Plane::new(rgb.width(), rgb.height(), data)
}

/// Guided filter of `p` with guide `guide` (same size), window radius `radius`,
/// regularisation `epsilon`.
pub fn guided_filter(guide: &Plane, p: &Plane, radius: u32, epsilon: f32) -> Plane {
    debug_assert_eq!((guide.width, guide.height), (p.width, p.height));
    let (w, h) = (guide.width as usize, guide.height as usize);
    let r = radius as usize;
    let mut boxf = BoxFilter::new(w, h, r);
    let i = &guide.data;
    let ip: Vec<f32> = i.iter().zip(&p.data).map(|(a, b)| a * b).collect();
    let ii: Vec<f32> = i.iter().map(|a| a * a).collect();
    let mean_i = boxf.mean(i);
    let mean_p = boxf.mean(&p.data);
    let corr_ip = boxf.mean(&ip);
    let corr_ii = boxf.mean(&ii);
    let mut a = ip; // reuse the allocation
    let mut b = ii;
    for k in 0..w * h {
        let cov = corr_ip[k] - mean_i[k] * mean_p[k];
        let var = corr_ii[k] - mean_i[k] * mean_i[k];
        a[k] = cov / (var + epsilon);
        b[k] = mean_p[k] - a[k] * mean_i[k];
    }
    let mean_a = boxf.mean(&a);
    let mean_b = boxf.mean(&b);
    let q = mean_a
        .iter()
        .zip(&mean_b)
        .zip(i)
        .map(|((ma, mb), iv)| ma * iv + mb)
        .collect();
    Plane::new(guide.width, guide.height, q)
}

/// Mean over the (2r+1)^2 window clipped to the image (sum of in-bounds samples over
/// their count). Sums run in f64 so that the running add/subtract does not drift on a
/// 4000-pixel line.
struct BoxFilter {
    w: usize,
    h: usize,
    r: usize,
    row_sums: Vec<f32>,
    column_acc: Vec<f64>,
    inv_count_x: Vec<f32>,
}

impl BoxFilter {
    fn new(w: usize, h: usize, r: usize) -> Self {
        let inv_count_x = (0..w).map(|x| 1.0 / window_len(x, r, w) as f32).collect();
        Self {
            w,
            h,
            r,
            row_sums: vec![0.0; w * h],
            column_acc: vec![0.0; w],
            inv_count_x,
        }
    }

    fn mean(&mut self, src: &[f32]) -> Vec<f32> {
        let (w, h, r) = (self.w, self.h, self.r);
        // Horizontal window sums.
        for (row, sums) in src.chunks_exact(w).zip(self.row_sums.chunks_exact_mut(w)) {
            let mut s: f64 = row[..=r.min(w - 1)].iter().map(|&v| f64::from(v)).sum();
            for x in 0..w {
                sums[x] = s as f32;
                if x + r + 1 < w {
                    s += f64::from(row[x + r + 1]);
                }
                if x >= r {
                    s -= f64::from(row[x - r]);
                }
            }
        }
        // Vertical window sums, a row at a time so memory is read in order.
        let mut out = vec![0f32; w * h];
        self.column_acc.iter_mut().for_each(|a| *a = 0.0);
        for y in 0..=r.min(h - 1) {
            add_row(
                &mut self.column_acc,
                &self.row_sums[y * w..(y + 1) * w],
                1.0,
            );
        }
        for y in 0..h {
            let inv_count_y = 1.0 / window_len(y, r, h) as f32;
            let dst = &mut out[y * w..(y + 1) * w];
            for ((d, a), icx) in dst.iter_mut().zip(&self.column_acc).zip(&self.inv_count_x) {
                *d = *a as f32 * icx * inv_count_y;
            }
            if y + r + 1 < h {
                let row = &self.row_sums[(y + r + 1) * w..(y + r + 2) * w];
                add_row(&mut self.column_acc, row, 1.0);
            }
            if y >= r {
                add_row(
                    &mut self.column_acc,
                    &self.row_sums[(y - r) * w..(y - r + 1) * w],
                    -1.0,
                );
            }
        }
        out
    }
}

fn add_row(acc: &mut [f64], row: &[f32], sign: f64) {
    for (a, &v) in acc.iter_mut().zip(row) {
        *a += sign * f64::from(v);
    }
}

/// How many of the samples `i - r ..= i + r` fall inside `0..len`.
fn window_len(i: usize, r: usize, len: usize) -> usize {
    (i + r).min(len - 1) - i.saturating_sub(r) + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute_box(src: &[f32], w: usize, h: usize, r: usize) -> Vec<f32> {
        let mut out = vec![0f32; w * h];
        for y in 0..h {
            for x in 0..w {
                let (mut s, mut n) = (0f64, 0usize);
                for yy in y.saturating_sub(r)..=(y + r).min(h - 1) {
                    for xx in x.saturating_sub(r)..=(x + r).min(w - 1) {
                        s += f64::from(src[yy * w + xx]);
                        n += 1;
                    }
                }
                out[y * w + x] = (s / n as f64) as f32;
            }
        }
        out
    }

    #[test]
    fn box_mean_equals_brute_force_including_edges() {
        for (w, h, r) in [(13, 7, 2), (5, 9, 4), (1, 1, 3), (8, 3, 10)] {
            let src: Vec<f32> = (0..w * h).map(|k| ((k * 37) % 11) as f32 / 10.0).collect();
            let fast = BoxFilter::new(w, h, r).mean(&src);
            let slow = brute_box(&src, w, h, r);
            for (a, b) in fast.iter().zip(&slow) {
                assert!((a - b).abs() < 1e-5, "w={w} h={h} r={r}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn constant_mask_passes_through() {
        let guide = Plane::new(6, 4, (0..24).map(|k| k as f32 / 24.0).collect());
        let p = Plane::filled(6, 4, 0.7);
        let q = guided_filter(&guide, &p, 2, 1e-3);
        assert!(
            q.data.iter().all(|v| (v - 0.7).abs() < 1e-4),
            "{:?}",
            q.data
        );
    }

    #[test]
    fn edge_follows_the_guide() {
        // The guide has a sharp edge at x = 8; the coarse mask a soft ramp around it.
        let (w, h) = (16usize, 4usize);
        let guide = Plane::new(
            w as u32,
            h as u32,
            (0..w * h)
                .map(|k| if k % w >= 8 { 1.0 } else { 0.0 })
                .collect(),
        );
        let p = Plane::new(
            w as u32,
            h as u32,
            (0..w * h)
                .map(|k| ((k % w) as f32 - 4.0).clamp(0.0, 8.0) / 8.0)
                .collect(),
        );
        let q = guided_filter(&guide, &p, 3, 1e-4);
        let row: Vec<f32> = q.data[w..2 * w].to_vec();
        // Sharper than the input across the edge: the step from x=7 to x=8 grows.
        assert!(row[8] - row[7] > p.data[8] - p.data[7] + 0.2, "{row:?}");
    }
}
