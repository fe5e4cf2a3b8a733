//! The bilinear resize of an f32 plane on the GPU (fast_image_resize's, as
//! `pipeline::resample::resize_plane`), with its tables and the horizontal pass's
//! scratch: the guided filter's mask to its fit size, a matting model's alpha to the
//! source's.

use std::sync::Arc;

use super::driver::{CudaSlice, CudaStream};

use super::launch::{taps_capacity, GpuTaps, Launcher};
use super::{CudaError, Size};

/// Tables and scratch for planes of at most `src_max` resized to at most `dst_max_side`
/// a side.
pub struct PlaneResize {
    /// fast_image_resize's coefficients in f32 (`GpuTaps::set_convolution`).
    horizontal: GpuTaps<f32>,
    vertical: GpuTaps<f32>,
    tmp: CudaSlice<f32>,
}

impl PlaneResize {
    pub fn alloc(
        stream: &Arc<CudaStream>,
        src_max: Size,
        dst_max_side: u32,
    ) -> Result<Self, CudaError> {
        let (h_out, h_weights) = taps_capacity(src_max.0, dst_max_side);
        let (v_out, v_weights) = taps_capacity(src_max.1, dst_max_side);
        Ok(Self {
            horizontal: GpuTaps::alloc(stream, h_out, h_weights)?,
            vertical: GpuTaps::alloc(stream, v_out, v_weights)?,
            // The horizontal pass: every output column of at most every source row.
            tmp: stream.alloc_zeros(dst_max_side as usize * src_max.1.max(1) as usize)?,
        })
    }

    /// The tables for `src` -> `dst` (nothing when already there), for upload while the
    /// stream is idle.
    pub fn set(&mut self, stream: &Arc<CudaStream>, src: Size, dst: Size) -> Result<(), CudaError> {
        self.horizontal.set_convolution(stream, src.0, dst.0)?;
        self.vertical.set_convolution(stream, src.1, dst.1)
    }

    /// `plane` (`src`) resized to `dst` size into `out`.
    pub fn run(
        &mut self,
        launcher: &Launcher<'_>,
        plane: &CudaSlice<f32>,
        src: Size,
        dst: Size,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.set(launcher.stream, src, dst)?;
        launcher.resize_plane(
            plane,
            src,
            &self.horizontal,
            &self.vertical,
            &mut self.tmp,
            out,
        )
    }
}
