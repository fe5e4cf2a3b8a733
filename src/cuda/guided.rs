//! The fast guided filter on the GPU (`pipeline::guided_filter`, He & Sun 2015): the
//! coarse mask and the image's luma are resized to 1/subsample of the source, the linear
//! model is fitted there, and `guided_alpha` applies it at full size where the trimap is
//! unknown. Owns the low-resolution buffers and the taps, all allocated at start-up.

use std::sync::Arc;

use super::driver::{CudaSlice, CudaStream};

use super::launch::{taps_capacity, GpuTaps, Launcher};
use super::plane_resize::PlaneResize;
use super::CudaError;

/// The filter's parameters, as `MattingSpec::GuidedFilter` gives them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuidedParams {
    pub radius: u32,
    pub epsilon: f32,
    pub subsample: u32,
}

impl GuidedParams {
    /// The subsample in use (`fit` treats 0 as 1).
    pub fn s(&self) -> u32 {
        self.subsample.max(1)
    }

    /// The fit's resolution for a `w` x `h` source: `ceil(size / subsample)`.
    pub fn low_size(&self, (w, h): (u32, u32)) -> (u32, u32) {
        (w.div_ceil(self.s()), h.div_ceil(self.s()))
    }

    /// The fit's radius: `radius / subsample` rounded half up, at least 1.
    pub fn low_radius(&self) -> u32 {
        let s = self.s();
        ((self.radius + s / 2) / s).max(1)
    }
}

/// The most pixels `ceil(W/s) * ceil(H/s)` reaches for `W * H <= max_pixels`, sides at
/// most `max_side`: `(W + s - 1)(H + s - 1) / s^2` with `W + H <= 2 max_side`.
pub fn low_capacity(max_pixels: u64, max_side: u32, subsample: u32) -> usize {
    let s = u64::from(subsample.max(1));
    let side = u64::from(max_side).div_ceil(s);
    let bound =
        (max_pixels + 2 * (s - 1) * u64::from(max_side) + (s - 1) * (s - 1)).div_ceil(s * s);
    usize::try_from(bound.min(side * side)).unwrap_or(usize::MAX)
}

/// A fitted `LinearModel` on the device: `mean_a` and `mean_b` hold `size.0 * size.1`
/// values (the buffers may be longer).
pub struct GpuLinearModel<'a> {
    pub size: (u32, u32),
    pub mean_a: &'a CudaSlice<f32>,
    pub mean_b: &'a CudaSlice<f32>,
}

/// The most pixels the guide's horizontal pass writes, `ceil(W/s) * H`, for
/// `W * H <= max_pixels`, sides at most `max_side`: at most `W * H / s + H`.
pub fn horizontal_capacity(max_pixels: u64, max_side: u32, subsample: u32) -> usize {
    let s = u64::from(subsample.max(1));
    let side = u64::from(max_side);
    let bound = (max_pixels / s + side).min(side.div_ceil(s) * side);
    usize::try_from(bound).unwrap_or(usize::MAX)
}

/// One replica's fast guided filter: buffers for sources up to the limits given at
/// allocation, masks up to `mask_max` a side, one subsample.
pub struct FastGuidedFilter {
    params: GuidedParams,
    /// PIL bilinear taps of the guide's resize (unused with subsample 1).
    guide_horizontal: GpuTaps<i32>,
    guide_vertical: GpuTaps<i32>,
    /// The guide resize's horizontal pass (its vertical pass writes the luma).
    rgb_tmp: CudaSlice<u8>,
    /// The mask's resize to the fit size.
    mask_resize: PlaneResize,
    guide: CudaSlice<f32>,
    p: CudaSlice<f32>,
    scratch: [CudaSlice<f32>; 4],
    mean_a: CudaSlice<f32>,
    mean_b: CudaSlice<f32>,
    /// The model's upsampling to the source size.
    up_x: GpuTaps<f32>,
    up_y: GpuTaps<f32>,
    /// The fit's size, once `fit` has run.
    fitted: Option<(u32, u32)>,
}

impl FastGuidedFilter {
    /// Buffers for sources of at most `max_pixels` and `max_side` a side, and masks of
    /// at most `mask_max` (w, h).
    pub fn alloc(
        stream: &Arc<CudaStream>,
        params: GuidedParams,
        max_pixels: u64,
        max_side: u32,
        mask_max: (u32, u32),
    ) -> Result<Self, CudaError> {
        let s = params.s();
        let low_side = max_side.div_ceil(s);
        let low_px = low_capacity(max_pixels, max_side, s);
        // With subsample 1 the guide is the source's luma: no RGB resize buffer.
        let (rgb_tmp, guide_side) = if s > 1 {
            (horizontal_capacity(max_pixels, max_side, s) * 3, max_side)
        } else {
            (1, 1)
        };
        let (gh_out, gh_w) = taps_capacity(guide_side, low_side);
        let (up_out, up_w) = taps_capacity(low_side, max_side);
        let plane = || stream.alloc_zeros::<f32>(low_px.max(1));
        Ok(Self {
            params,
            guide_horizontal: GpuTaps::alloc(stream, gh_out, gh_w)?,
            guide_vertical: GpuTaps::alloc(stream, gh_out, gh_w)?,
            rgb_tmp: stream.alloc_zeros(rgb_tmp)?,
            mask_resize: PlaneResize::alloc(stream, mask_max, low_side)?,
            guide: plane()?,
            p: plane()?,
            scratch: [plane()?, plane()?, plane()?, plane()?],
            mean_a: plane()?,
            mean_b: plane()?,
            up_x: GpuTaps::alloc(stream, up_out, up_w)?,
            up_y: GpuTaps::alloc(stream, up_out, up_w)?,
            fitted: None,
        })
    }

    /// Every table `fit` and `alpha` need for a source of `size` and a mask of
    /// `mask_size`, made on the device (nothing when already there), so that a caller
    /// can queue them before its request's first copy.
    pub fn make_tables(
        &mut self,
        launcher: &Launcher<'_>,
        size: (u32, u32),
        mask_size: (u32, u32),
    ) -> Result<(), CudaError> {
        let low = self.params.low_size(size);
        self.mask_resize.set(launcher, mask_size, low)?;
        if self.params.s() > 1 {
            self.guide_horizontal.set_fixed(launcher, size.0, low.0)?;
            self.guide_vertical.set_fixed(launcher, size.1, low.1)?;
        }
        self.up_x.set_upsample(launcher, low.0, size.0)?;
        self.up_y.set_upsample(launcher, low.1, size.1)
    }

    /// `guided_filter::fit`: the model of `coarse` (`mask_size`) for the RGB8 `image`
    /// (`size`, on the device), at `params.low_size(size)`.
    pub fn fit(
        &mut self,
        launcher: &Launcher<'_>,
        image: &CudaSlice<u8>,
        size: (u32, u32),
        coarse: &CudaSlice<f32>,
        mask_size: (u32, u32),
    ) -> Result<(), CudaError> {
        let low = self.params.low_size(size);
        let low_px = u64::from(low.0) * u64::from(low.1);
        self.fitted = None;
        self.mask_resize
            .run(launcher, coarse, mask_size, low, &mut self.p)?;
        let low32 = u32::try_from(low_px).map_err(|_| CudaError::Stage {
            stage: "guided filter",
            reason: format!("{}x{} does not fit the kernels' 32-bit sizes", low.0, low.1),
        })?;
        if self.params.s() > 1 {
            self.guide_horizontal.set_fixed(launcher, size.0, low.0)?;
            self.guide_vertical.set_fixed(launcher, size.1, low.1)?;
            // The resize's vertical pass makes the luma itself: the resized RGB8 (and
            // its max, which only the preprocess's "max" scale needs) is never stored.
            launcher.resize_rgb8_luma(
                image,
                size,
                &self.guide_horizontal,
                &self.guide_vertical,
                &mut self.rgb_tmp,
                &mut self.guide,
            )?;
        } else {
            launcher.luma(image, low32, &mut self.guide)?;
        }
        launcher.guided_coefficients(
            &self.guide,
            &self.p,
            low,
            self.params.low_radius(),
            self.params.epsilon,
            &mut self.scratch,
            &mut self.mean_a,
            &mut self.mean_b,
        )?;
        self.fitted = Some(low);
        Ok(())
    }

    /// `LinearModel::alpha` of the last fit: alpha (and with `cutout` the RGBA cut-out)
    /// of the RGB8 `image` (`size`, the size `fit` saw) under `trimap`.
    pub fn alpha(
        &mut self,
        launcher: &Launcher<'_>,
        image: &CudaSlice<u8>,
        size: (u32, u32),
        trimap: &CudaSlice<u8>,
        alpha: &mut CudaSlice<u8>,
        cutout: Option<&mut CudaSlice<u8>>,
    ) -> Result<(), CudaError> {
        let low = self.params.low_size(size);
        if self.fitted != Some(low) {
            return Err(CudaError::Stage {
                stage: "guided filter",
                reason: format!("no model fitted for a {}x{} source", size.0, size.1),
            });
        }
        self.up_x.set_upsample(launcher, low.0, size.0)?;
        self.up_y.set_upsample(launcher, low.1, size.1)?;
        launcher.guided_alpha(
            &self.mean_a,
            &self.mean_b,
            low,
            &self.up_x,
            &self.up_y,
            image,
            trimap,
            size,
            alpha,
            cutout,
        )
    }

    /// The last fit's model on the device, for tests.
    pub fn model(&self) -> Option<GpuLinearModel<'_>> {
        self.fitted.map(|size| GpuLinearModel {
            size,
            mean_a: &self.mean_a,
            mean_b: &self.mean_b,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_resolution_follows_fit() {
        let p = GuidedParams {
            radius: 8,
            epsilon: 1e-3,
            subsample: 4,
        };
        assert_eq!(p.low_size((4032, 3024)), (1008, 756));
        assert_eq!(p.low_size((1, 1)), (1, 1));
        assert_eq!(p.low_size((1918, 1077)), (480, 270));
        assert_eq!(p.low_radius(), 2);
        let r = |radius, subsample| {
            GuidedParams {
                radius,
                epsilon: 0.0,
                subsample,
            }
            .low_radius()
        };
        // Half up, at least 1; subsample 0 is 1, as `fit` reads it.
        assert_eq!(
            (r(6, 4), r(5, 4), r(1, 4), r(8, 1), r(8, 0)),
            (2, 1, 1, 8, 8)
        );
    }

    #[test]
    fn allocated_taps_hold_every_table_up_to_the_limits() {
        use crate::cuda::taps::{ConvolutionTaps, FixedTaps, UpsampleTaps};
        let side = 4032u32;
        for s in 1..=16u32 {
            let low_side = side.div_ceil(s);
            let guide = taps_capacity(side, low_side);
            let mask = taps_capacity(320, low_side);
            let up = taps_capacity(low_side, side);
            for w in [1u32, 2, 3, 5, 17, 100, 333, 1001, 1918, 3023, 4031, 4032] {
                let low = w.div_ceil(s);
                let g = FixedTaps::bilinear(w, low);
                assert!(
                    g.first.len() <= guide.0 && g.weights.len() <= guide.1,
                    "guide {w}/{s}"
                );
                let m = ConvolutionTaps::bilinear(320, low);
                assert!(
                    m.first.len() <= mask.0 && m.weights.len() <= mask.1,
                    "mask {w}/{s}"
                );
                let u = UpsampleTaps::bilinear(low, w);
                assert!(
                    u.first.len() <= up.0 && u.weights.len() <= up.1,
                    "up {w}/{s}"
                );
            }
        }
    }

    #[test]
    fn low_capacity_bounds_every_shape_within_the_limits() {
        for (max_px, side) in [
            (100u64, 40u32),
            (5000, 97),
            (4032 * 3024, 4032),
            (50_000_000, 16_384),
        ] {
            for s in 1..=5u32 {
                let cap = low_capacity(max_px, side, s) as u64;
                let mut worst = 0u64;
                for w in 1..=side {
                    let h = (max_px / u64::from(w)).min(u64::from(side)) as u32;
                    if h == 0 {
                        continue;
                    }
                    let low = u64::from(w.div_ceil(s)) * u64::from(h.div_ceil(s));
                    worst = worst.max(low);
                }
                assert!(
                    worst <= cap,
                    "{max_px} px, side {side}, s {s}: {worst} > {cap}"
                );
                if s == 1 {
                    assert_eq!(cap, max_px.min(u64::from(side) * u64::from(side)));
                }
            }
        }
    }
}
