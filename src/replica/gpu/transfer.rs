//! The bus: a request's one upload (the decoded RGB8) and one download (alpha, trimap and,
//! when asked, the RGBA cut-out, back to back before one synchronisation), through
//! page-locked staging so the copies are DMA the host need not wait for. The staging
//! grows to the largest request seen and is kept: not sized up front for the largest
//! image the limits allow (9 bytes a pixel, up and down: 450 MB per replica at 50
//! megapixels), and not per request either, pinning being slow.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PinnedHostSlice};
use image::{GrayImage, RgbImage, RgbaImage};

use crate::cuda::{pinned, CudaError};

/// One direction's staging, grown on demand.
struct Staging {
    context: Arc<CudaContext>,
    write_combined: bool,
    buffer: Option<PinnedHostSlice<u8>>,
}

impl Staging {
    /// The staging, at least `len` bytes (one and a half times the old size when it
    /// grows, so that a run of slightly larger images does not pin each time). Only at
    /// the start of a request, after the stream is synchronised: no copy uses the old one.
    fn at_least(&mut self, len: usize) -> Result<&mut PinnedHostSlice<u8>, CudaError> {
        let have = self.buffer.as_ref().map_or(0, PinnedHostSlice::len);
        if have < len {
            let grown = len.max(have + have / 2);
            // The old buffer goes first: both at once could pin twice the memory.
            self.buffer = None;
            self.buffer = Some(pinned(&self.context, grown, self.write_combined)?);
        }
        self.buffer.as_mut().ok_or(CudaError::BufferTooSmall {
            what: "pinned staging",
            needed: len,
            capacity: 0,
        })
    }

    fn bytes(&self) -> usize {
        self.buffer.as_ref().map_or(0, PinnedHostSlice::len)
    }
}

/// A replica's staging in both directions, on its stream.
pub struct Transfer {
    stream: Arc<CudaStream>,
    up: Staging,
    down: Staging,
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // A copy still queued reads or writes the staging about to be unpinned: let it end.
        let _ = self.stream.synchronize();
    }
}

/// What a request's download brings back.
pub struct Downloaded {
    pub alpha: GrayImage,
    pub trimap: GrayImage,
    pub cutout: Option<RgbaImage>,
}

impl Transfer {
    pub fn new(stream: &Arc<CudaStream>) -> Self {
        let context = stream.context();
        Self {
            stream: stream.clone(),
            up: Staging {
                context: context.clone(),
                write_combined: true,
                buffer: None,
            },
            down: Staging {
                context: context.clone(),
                write_combined: false,
                buffer: None,
            },
        }
    }

    /// Host memory pinned now, both directions.
    pub fn pinned_bytes(&self) -> usize {
        self.up.bytes() + self.down.bytes()
    }

    /// Makes room for a request of `pixels` (the cut-out too when `cutout`): call with the
    /// stream idle.
    pub fn reserve(&mut self, pixels: usize, cutout: bool) -> Result<(), CudaError> {
        self.up.at_least(3 * pixels)?;
        self.down.at_least(if cutout { 6 } else { 2 } * pixels)?;
        Ok(())
    }

    /// Queues the upload of `image` into `dst` (at least its size).
    pub fn upload(&mut self, image: &RgbImage, dst: &mut CudaSlice<u8>) -> Result<(), CudaError> {
        let raw = image.as_raw();
        let staging = self.up.at_least(raw.len())?;
        staging.as_mut_slice()?[..raw.len()].copy_from_slice(raw);
        let staged = &staging.as_slice()?[..raw.len()];
        self.stream.memcpy_htod(staged, dst)?;
        Ok(())
    }

    /// Queues the downloads of alpha, trimap (each `w` x `h`) and, when given, the RGBA
    /// cut-out, then synchronises the stream once and gives them back.
    pub fn download(
        &mut self,
        (w, h): (u32, u32),
        alpha: &CudaSlice<u8>,
        trimap: &CudaSlice<u8>,
        cutout: Option<&CudaSlice<u8>>,
    ) -> Result<Downloaded, CudaError> {
        let n = w as usize * h as usize;
        let len = if cutout.is_some() { 6 * n } else { 2 * n };
        let stream = self.stream.clone();
        let host = self.down.at_least(len)?.as_mut_slice()?;
        let (alpha_host, rest) = host.split_at_mut(n);
        let (trimap_host, rest) = rest.split_at_mut(n);
        stream.memcpy_dtoh(&alpha.slice(..n), alpha_host)?;
        stream.memcpy_dtoh(&trimap.slice(..n), trimap_host)?;
        if let Some(rgba) = cutout {
            stream.memcpy_dtoh(&rgba.slice(..4 * n), &mut rest[..4 * n])?;
        }
        stream.synchronize()?;
        let host = self.down.at_least(len)?.as_slice()?;
        let mismatch = |what: &str| CudaError::Stage {
            stage: "download",
            reason: format!("{what} buffer does not match {w}x{h}"),
        };
        Ok(Downloaded {
            alpha: GrayImage::from_raw(w, h, host[..n].to_vec())
                .ok_or_else(|| mismatch("alpha"))?,
            trimap: GrayImage::from_raw(w, h, host[n..2 * n].to_vec())
                .ok_or_else(|| mismatch("trimap"))?,
            cutout: match cutout {
                Some(_) => Some(
                    RgbaImage::from_raw(w, h, host[2 * n..6 * n].to_vec())
                        .ok_or_else(|| mismatch("cut-out"))?,
                ),
                None => None,
            },
        })
    }
}
