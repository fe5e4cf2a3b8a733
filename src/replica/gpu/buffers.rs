//! What a GPU replica's device buffers are sized for (`GpuLimits`) and the planes at the
//! source size that its stages share (`SourcePlanes`). A leaf: the stages import it, and
//! it imports none of them.

use std::sync::Arc;

use crate::cuda::driver::{CudaSlice, CudaStream};

use crate::cuda::CudaError;

/// The largest image the GPU buffers hold. Larger images are refused with
/// [`CudaError::ImageTooLarge`] (the caller can run them on the CPU path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuLimits {
    pub max_pixels: u64,
    pub max_side_px: u32,
}

impl Default for GpuLimits {
    /// The decoder's default limits, so that every image it accepts fits.
    fn default() -> Self {
        let decode = crate::codec::decode::DecodeLimits::default();
        Self {
            max_pixels: decode.max_pixels,
            max_side_px: decode.max_side_px,
        }
    }
}

impl GpuLimits {
    /// The size of a `width` x `height` image, if the buffers hold it.
    pub fn accept(&self, width: u32, height: u32) -> Result<(u32, u32), CudaError> {
        let pixels = u64::from(width) * u64::from(height);
        if pixels > self.max_pixels || width.max(height) > self.max_side_px || pixels == 0 {
            return Err(CudaError::ImageTooLarge {
                width,
                height,
                limit: format!("{} pixels, {} px a side", self.max_pixels, self.max_side_px),
            });
        }
        Ok((width, height))
    }
}

/// Planes at the source size.
pub struct SourcePlanes {
    pub image: CudaSlice<u8>,
    pub trimap: CudaSlice<u8>,
    pub alpha: CudaSlice<u8>,
    pub rgba: CudaSlice<u8>,
}

impl SourcePlanes {
    /// Planes for the largest image `limits` accept, on `stream`.
    pub fn alloc(stream: &Arc<CudaStream>, limits: &GpuLimits) -> Result<Self, CudaError> {
        let max_px = usize::try_from(limits.max_pixels).unwrap_or(usize::MAX);
        Ok(Self {
            image: stream.alloc_zeros(max_px * 3)?,
            trimap: stream.alloc_zeros(max_px)?,
            alpha: stream.alloc_zeros(max_px)?,
            rgba: stream.alloc_zeros(max_px * 4)?,
        })
    }
}
