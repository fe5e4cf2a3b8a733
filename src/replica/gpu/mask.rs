//! The segmentation output on the GPU becomes the trimap: thresholds (or argmax over class
//! scores) at the output's resolution, with the coarse mask in [0, 1] the guided filter
//! fits, the erosion that widens the unknown band, then PIL NEAREST to the source size.

use std::sync::Arc;

use crate::cuda::driver::{CudaSlice, CudaStream};

use crate::cuda::launch::{GpuNearest, Launcher};
use crate::cuda::CudaError;
use crate::spec::{MaskKind, PipelineSpec};

/// The trimap stage's buffers, at the segmentation output's resolution.
pub struct MaskStage {
    /// `[1, C, H, W]` of the segmentation output.
    shape: [usize; 4],
    lohi: CudaSlice<u32>,
    /// The mask in [0, 1] (the class value / 255 for class scores).
    pub coarse: CudaSlice<f32>,
    /// The trimap at the output's resolution.
    pub trimap: CudaSlice<u8>,
    flags: CudaSlice<u8>,
    class_values: CudaSlice<u8>,
    /// NEAREST indices from the output's resolution to the source's.
    to_source: GpuNearest,
}

impl MaskStage {
    /// Buffers for a segmentation output of `shape`, and sources up to `max_side`.
    pub fn alloc(
        stream: &Arc<CudaStream>,
        spec: &PipelineSpec,
        shape: [usize; 4],
        max_side: u32,
    ) -> Result<Self, CudaError> {
        let plane = shape[2] * shape[3];
        let class_values: Vec<u8> = match &spec.segmentation.mask {
            MaskKind::Classes { class_values } => class_values.clone(),
            MaskKind::Probability { .. } => vec![0],
        };
        let mut class_buf = stream.alloc_zeros::<u8>(class_values.len().max(1))?;
        stream.memcpy_htod(&class_values, &mut class_buf)?;
        Ok(Self {
            shape,
            lohi: stream.alloc_zeros(2)?,
            coarse: stream.alloc_zeros(plane)?,
            trimap: stream.alloc_zeros(plane)?,
            flags: stream.alloc_zeros(plane)?,
            class_values: class_buf,
            to_source: GpuNearest::alloc(stream, max_side, max_side)?,
        })
    }

    /// `(width, height)` of the segmentation output (and of `coarse` and `trimap`).
    pub fn size(&self) -> (u32, u32) {
        (self.shape[3] as u32, self.shape[2] as u32)
    }

    /// The NEAREST indices to a source of `size`, made on the device (nothing when already
    /// there).
    pub fn make_tables(
        &mut self,
        launcher: &Launcher<'_>,
        size: (u32, u32),
    ) -> Result<(), CudaError> {
        self.to_source.set(launcher, self.size(), size)
    }

    /// The trimap of the segmentation output `mask`, eroded, at the output's resolution
    /// (`self.trimap`, and `self.coarse`), and NEAREST to `source` size into `trimap`.
    pub fn run(
        &mut self,
        launcher: &Launcher<'_>,
        spec: &PipelineSpec,
        mask: &CudaSlice<f32>,
        source: (u32, u32),
        trimap: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let small = self.size();
        let classes = self.shape[1];
        match &spec.segmentation.mask {
            MaskKind::Probability { minmax } => launcher.probability_trimap(
                mask,
                small,
                *minmax,
                spec.trimap.foreground,
                spec.trimap.background,
                &mut self.lohi,
                &mut self.coarse,
                &mut self.trimap,
            )?,
            MaskKind::Classes { class_values } => {
                if classes != class_values.len() {
                    return Err(CudaError::Stage {
                        stage: "trimap",
                        reason: format!(
                            "the output has {classes} classes, the pipeline description maps {}",
                            class_values.len()
                        ),
                    });
                }
                launcher.classes_trimap(
                    mask,
                    small,
                    classes as u32,
                    &self.class_values,
                    &mut self.coarse,
                    &mut self.trimap,
                )?
            }
        }
        launcher.erode(
            &mut self.trimap,
            small,
            spec.trimap.erode_px,
            &mut self.flags,
        )?;
        self.to_source.set(launcher, small, source)?;
        launcher.resize_nearest(&self.trimap, &self.to_source, trimap)
    }
}
