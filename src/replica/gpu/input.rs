//! A model input on the GPU: PIL's bilinear resize of the uploaded image to the model's
//! input size, normalised into the model's own input tensor (f32 or f16). The resize
//! tables are made on the device once per source size (`GpuTaps::set_fixed`).

use std::sync::Arc;

use crate::cuda::driver::{CudaSlice, CudaStream};

use super::buffers::GpuLimits;
use crate::cuda::launch::{taps_capacity, GpuTaps, Launcher, ModelInput};
use crate::cuda::CudaError;
use crate::spec::ImageInputSpec;

/// The scratch of one input's resize: sized at start-up for the largest image accepted.
pub struct InputStage {
    pub spec: ImageInputSpec,
    horizontal: GpuTaps<i32>,
    vertical: GpuTaps<i32>,
    tmp: CudaSlice<u8>,
    resized: CudaSlice<u8>,
    max_value: CudaSlice<u32>,
}

impl InputStage {
    pub fn alloc(
        stream: &Arc<CudaStream>,
        spec: &ImageInputSpec,
        limits: &GpuLimits,
    ) -> Result<Self, CudaError> {
        let (w, h) = (spec.width, spec.height);
        let (outs_h, weights_h) = taps_capacity(limits.max_side_px, w);
        let (outs_v, weights_v) = taps_capacity(limits.max_side_px, h);
        Ok(Self {
            spec: spec.clone(),
            horizontal: GpuTaps::alloc(stream, outs_h, weights_h)?,
            vertical: GpuTaps::alloc(stream, outs_v, weights_v)?,
            // The horizontal pass covers at most every source row.
            tmp: stream.alloc_zeros(w as usize * limits.max_side_px as usize * 3)?,
            resized: stream.alloc_zeros(w as usize * h as usize * 3)?,
            max_value: stream.alloc_zeros(1)?,
        })
    }

    /// `(width, height)` of the model input.
    pub fn size(&self) -> (u32, u32) {
        (self.spec.width, self.spec.height)
    }

    /// The resize tables for a source of `size`, made on the device (nothing when already
    /// there).
    pub fn make_taps(
        &mut self,
        launcher: &Launcher<'_>,
        size: (u32, u32),
    ) -> Result<(), CudaError> {
        self.horizontal
            .set_fixed(launcher, size.0, self.spec.width)?;
        self.vertical.set_fixed(launcher, size.1, self.spec.height)
    }

    /// Resize + normalise `image` (on the device, `size`) into `out`.
    pub fn run(
        &mut self,
        launcher: &Launcher<'_>,
        image: &CudaSlice<u8>,
        size: (u32, u32),
        out: ModelInput<'_>,
    ) -> Result<(), CudaError> {
        self.make_taps(launcher, size)?;
        launcher.preprocess(
            image,
            size,
            &self.horizontal,
            &self.vertical,
            self.size(),
            &self.spec.normalize,
            &mut self.tmp,
            &mut self.resized,
            &mut self.max_value,
            out,
        )
    }
}
