//! The bus: a request's one upload (the decoded RGB8) and one download (the planes the
//! answer shows: the RGBA cut-out alone for a cut-out, whose alpha travels inside it;
//! back to back before one synchronisation when there are several), through page-locked
//! staging so the copies are DMA the host need not wait for.
//!
//! The staging is pinned at load for `GpuLimits::staging_pixels` (9 bytes a pixel: 3 up,
//! 6 down for the largest answer, JSON's three planes) and never pinned, grown or freed on
//! the request path: pinning takes milliseconds and freeing pinned memory synchronises
//! the device. A request larger than the staging copies through pageable memory (the
//! driver stages it, and the download waits), and asks a background thread to pin staging
//! of its size; the replica takes it up at a later request's start, and the old staging
//! is unpinned on that thread too.

use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use image::{GrayImage, RgbImage, RgbaImage};

use crate::cuda::{CudaError, PinnedBytes};
use crate::matte::Planes;

/// Bytes of staging a pixel takes in each direction.
const UP_BYTES_PER_PIXEL: usize = 3;
const DOWN_BYTES_PER_PIXEL: usize = 6;

/// One direction's staging, pinned at load and grown in the background.
struct Staging {
    context: Arc<CudaContext>,
    write_combined: bool,
    bytes_per_pixel: usize,
    buffer: PinnedBytes,
    /// A larger staging being pinned by a background thread.
    growing: Option<Receiver<Result<PinnedBytes, CudaError>>>,
}

impl Staging {
    fn pin(
        context: &Arc<CudaContext>,
        write_combined: bool,
        bytes_per_pixel: usize,
        pixels: usize,
    ) -> Result<Self, CudaError> {
        Ok(Self {
            context: context.clone(),
            write_combined,
            bytes_per_pixel,
            buffer: PinnedBytes::new(context, bytes_per_pixel * pixels, write_combined)?,
            growing: None,
        })
    }

    /// Whether `len` bytes fit; if not, a larger staging is asked for (once) in the
    /// background.
    fn fits(&mut self, len: usize) -> bool {
        if self.buffer.len() >= len {
            return true;
        }
        if self.growing.is_none() {
            let (context, write_combined) = (self.context.clone(), self.write_combined);
            // Half as much again, so that a run of slightly larger images pins once.
            let grown = (len + len / 2).next_multiple_of(self.bytes_per_pixel);
            let (tx, rx) = mpsc::channel();
            let spawned = std::thread::Builder::new()
                .name("celer-pin".into())
                .spawn(move || {
                    let _ = tx.send(PinnedBytes::new(&context, grown, write_combined));
                });
            if spawned.is_ok() {
                self.growing = Some(rx);
            }
        }
        false
    }

    /// Takes up a staging pinned in the background, if one is ready. Only at the start of a
    /// request, with the stream idle: no copy uses the old one, which is unpinned on a
    /// thread of its own (freeing pinned memory waits for the device).
    fn take_grown(&mut self) {
        let Some(rx) = &self.growing else { return };
        match rx.try_recv() {
            Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => self.growing = None,
            Ok(result) => {
                self.growing = None;
                match result {
                    Ok(grown) if grown.len() > self.buffer.len() => {
                        let old = std::mem::replace(&mut self.buffer, grown);
                        let _ = std::thread::Builder::new()
                            .name("celer-unpin".into())
                            .spawn(move || drop(old));
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(
                        error = %e,
                        "cannot pin larger staging: larger images keep copying through pageable memory"
                    ),
                }
            }
        }
    }
}

/// A replica's staging in both directions, on its stream.
pub struct Transfer {
    stream: Arc<CudaStream>,
    up: Staging,
    down: Staging,
    /// Where this request's download went.
    pending: Option<Pending>,
}

/// Where a request's planes were downloaded to: alpha, trimap and cut-out, each asked for
/// or not.
struct Pending {
    size: (u32, u32),
    planes: [Option<Landed>; 3],
}

/// Where one plane's bytes landed.
enum Landed {
    /// In the download staging, at this range.
    Staged(std::ops::Range<usize>),
    /// Larger than the staging: straight into a host vector (pageable).
    Pageable(Vec<u8>),
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // A copy still queued reads or writes the staging about to be unpinned: let it end.
        let _ = self.stream.synchronize();
    }
}

/// What a request's download brings back: the planes asked for.
pub struct Downloaded {
    pub alpha: Option<GrayImage>,
    pub trimap: Option<GrayImage>,
    pub cutout: Option<RgbaImage>,
}

/// The device buffers a download may read, each at least the source size.
pub struct DevicePlanes<'a> {
    pub alpha: &'a CudaSlice<u8>,
    pub trimap: &'a CudaSlice<u8>,
    pub rgba: &'a CudaSlice<u8>,
}

impl Transfer {
    /// Staging for images up to `pixels`, pinned now.
    pub fn new(stream: &Arc<CudaStream>, pixels: usize) -> Result<Self, CudaError> {
        let context = stream.context();
        Ok(Self {
            stream: stream.clone(),
            up: Staging::pin(context, true, UP_BYTES_PER_PIXEL, pixels)?,
            down: Staging::pin(context, false, DOWN_BYTES_PER_PIXEL, pixels)?,
            pending: None,
        })
    }

    /// Host memory pinned now, both directions.
    pub fn pinned_bytes(&self) -> usize {
        self.up.buffer.len() + self.down.buffer.len()
    }

    /// At a request's start, with the stream idle: takes up staging grown since.
    pub fn settle(&mut self) {
        self.up.take_grown();
        self.down.take_grown();
        self.pending = None;
    }

    /// Queues the upload of `image` into `dst` (at least its size).
    pub fn upload(&mut self, image: &RgbImage, dst: &mut CudaSlice<u8>) -> Result<(), CudaError> {
        let raw = image.as_raw();
        if !self.up.fits(raw.len()) {
            // Pageable: the driver copies it out before the call returns.
            self.stream.memcpy_htod(raw.as_slice(), dst)?;
            return Ok(());
        }
        let staging = self.up.buffer.as_mut_slice();
        staging[..raw.len()].copy_from_slice(raw);
        self.stream.memcpy_htod(&staging[..raw.len()], dst)?;
        Ok(())
    }

    /// Queues the download of the `wanted` planes of a `w` x `h` image from `device`; the
    /// caller synchronises the stream, then `take`s them.
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
        let len: usize = lens.iter().filter(|(on, _)| *on).map(|(_, l)| l).sum();
        let stream = self.stream.clone();
        let sources = [device.alpha, device.trimap, device.rgba];
        let staged = self.down.fits(len);
        let host = self.down.buffer.as_mut_slice();
        let mut planes = [None, None, None];
        let mut at = 0;
        for (((on, l), src), plane) in lens.iter().zip(sources).zip(planes.iter_mut()) {
            if !*on {
                continue;
            }
            let src = src.slice(..*l);
            *plane = Some(if staged {
                stream.memcpy_dtoh(&src, &mut host[at..at + l])?;
                at += l;
                Landed::Staged(at - l..at)
            } else {
                Landed::Pageable(stream.clone_dtoh(&src)?)
            });
        }
        self.pending = Some(Pending {
            size: (w, h),
            planes,
        });
        Ok(())
    }

    /// The planes of the last `queue_download`, once the stream is synchronised.
    pub fn take(&mut self) -> Result<Downloaded, CudaError> {
        let pending = self.pending.take().ok_or(CudaError::Stage {
            stage: "download",
            reason: "nothing was downloaded".into(),
        })?;
        let (w, h) = pending.size;
        let mismatch = |what: &str| CudaError::Stage {
            stage: "download",
            reason: format!("{what} buffer does not match {w}x{h}"),
        };
        let host = self.down.buffer.as_slice();
        let [alpha, trimap, cutout] = pending.planes.map(|landed| {
            landed.map(|landed| match landed {
                Landed::Staged(range) => host[range].to_vec(),
                Landed::Pageable(bytes) => bytes,
            })
        });
        let gray = |what, bytes: Option<Vec<u8>>| {
            bytes
                .map(|b| GrayImage::from_raw(w, h, b).ok_or_else(|| mismatch(what)))
                .transpose()
        };
        Ok(Downloaded {
            alpha: gray("alpha", alpha)?,
            trimap: gray("trimap", trimap)?,
            cutout: cutout
                .map(|b| RgbaImage::from_raw(w, h, b).ok_or_else(|| mismatch("cut-out")))
                .transpose()?,
        })
    }
}
