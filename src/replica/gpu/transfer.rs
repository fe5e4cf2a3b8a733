//! The bus: a request's one upload (the decoded RGB8, straight from the block the decoder
//! wrote) and one download (the planes the answer shows, each straight into a block the
//! encoder will read: the RGBA cut-out alone for a cut-out, whose alpha travels inside
//! it; back to back before one synchronisation when there are several). The blocks come
//! from the server's page-locked pool (`crate::cuda::host_pool`), so both copies are DMA
//! and the host copies no pixels between decode and encode. A block the pool could not
//! lend (it ran dry, or the image is larger than its blocks) is heap memory, which the
//! driver copies through its own staging.
//!
//! A queued copy reads or writes its block until the stream reaches it, so the blocks of
//! a request stay here until the stream is known idle: taken when the request's one
//! synchronisation returns, or, after a request that failed part-way, at the next one's
//! start (`settle`, after its synchronisation).

use std::sync::Arc;

use crate::cuda::driver::{CudaSlice, CudaStream};

use crate::cuda::CudaError;
use crate::matte::Planes;
use crate::pixels::{GrayPixels, HostBytes, RgbPixels, RgbaPixels, SharedAlloc};

/// A replica's copies to and from the host, on its stream.
pub struct Transfer {
    stream: Arc<CudaStream>,
    blocks: SharedAlloc,
    /// The image of this request's upload, held until its copy is known done.
    uploaded: Option<Arc<RgbPixels>>,
    /// Where this request's download went.
    pending: Option<Pending>,
}

/// Where a request's planes were downloaded to: alpha, trimap and cut-out, each asked for
/// or not.
struct Pending {
    size: (u32, u32),
    planes: [Option<HostBytes>; 3],
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // A copy still queued reads or writes a block about to go back to the pool.
        let _ = self.stream.synchronize();
    }
}

/// What a request's download brings back: the planes asked for.
pub struct Downloaded {
    pub alpha: Option<GrayPixels>,
    pub trimap: Option<GrayPixels>,
    pub cutout: Option<RgbaPixels>,
}

/// The device buffers a download may read, each at least the source size.
pub struct DevicePlanes<'a> {
    pub alpha: &'a CudaSlice<u8>,
    pub trimap: &'a CudaSlice<u8>,
    pub rgba: &'a CudaSlice<u8>,
}

impl Transfer {
    /// Copies on `stream`, downloads into blocks from `blocks`.
    pub fn new(stream: &Arc<CudaStream>, blocks: SharedAlloc) -> Self {
        Self {
            stream: stream.clone(),
            blocks,
            uploaded: None,
            pending: None,
        }
    }

    /// At a request's start, with the stream idle: the last request's blocks go back.
    pub fn settle(&mut self) {
        self.uploaded = None;
        self.pending = None;
    }

    /// Queues the upload of `image` into `dst` (at least its size), from the image's own
    /// block.
    pub fn upload(
        &mut self,
        image: &Arc<RgbPixels>,
        dst: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        self.uploaded = Some(image.clone());
        self.stream.memcpy_htod(&image.as_raw()[..], dst)?;
        Ok(())
    }

    /// Queues the download of the `wanted` planes of a `w` x `h` image from `device`, each
    /// into a block of its own; the caller synchronises the stream, then `take`s them.
    pub fn queue_download(
        &mut self,
        (w, h): (u32, u32),
        wanted: Planes,
        device: DevicePlanes<'_>,
    ) -> Result<(), CudaError> {
        let n = w as usize * h as usize;
        let lens = [
            (wanted.alpha, n),
            (wanted.trimap, n),
            (wanted.cutout, 4 * n),
        ];
        let sources = [device.alpha, device.trimap, device.rgba];
        // Held here from the first copy, so that a failure part-way keeps what was queued.
        let pending = self.pending.insert(Pending {
            size: (w, h),
            planes: [None, None, None],
        });
        for (((on, len), src), plane) in lens.iter().zip(sources).zip(pending.planes.iter_mut()) {
            if !*on {
                continue;
            }
            let block = plane.insert(self.blocks.alloc(*len));
            self.stream
                .memcpy_dtoh(&src.slice(..*len)?, &mut block[..])?;
        }
        Ok(())
    }

    /// The planes of the last `queue_download`, once the stream is synchronised; the
    /// upload's block goes back too.
    pub fn take(&mut self) -> Result<Downloaded, CudaError> {
        self.uploaded = None;
        let pending = self.pending.take().ok_or(CudaError::Stage {
            stage: "download",
            reason: "nothing was downloaded".into(),
        })?;
        let (w, h) = pending.size;
        let mismatch = |what: &str| CudaError::Stage {
            stage: "download",
            reason: format!("{what} buffer does not match {w}x{h}"),
        };
        let [alpha, trimap, cutout] = pending.planes;
        let gray = |what, bytes: Option<HostBytes>| {
            bytes
                .map(|b| GrayPixels::from_raw(w, h, b).ok_or_else(|| mismatch(what)))
                .transpose()
        };
        Ok(Downloaded {
            alpha: gray("alpha", alpha)?,
            trimap: gray("trimap", trimap)?,
            cutout: cutout
                .map(|b| RgbaPixels::from_raw(w, h, b).ok_or_else(|| mismatch("cut-out")))
                .transpose()?,
        })
    }
}
