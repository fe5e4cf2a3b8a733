//! Host memory for a request's pixels: the decoded image a device reads and the planes
//! it hands back, from the decoder's writes to the encoder's reads without a copy in
//! between. `HostBytes` is either an ordinary heap vector or a block leased from an
//! allocator (`HostAlloc`): where GPUs serve, a pool of page-locked blocks
//! (`crate::cuda::host_pool`), which a GPU's copies read and write as DMA; on the CPU
//! alone, the heap. The ground floor: imports nothing of celer's.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use image::{ImageBuffer, Luma, Rgb, Rgba};

/// An image whose pixels live in `HostBytes`.
pub type RgbPixels = ImageBuffer<Rgb<u8>, HostBytes>;
pub type GrayPixels = ImageBuffer<Luma<u8>, HostBytes>;
pub type RgbaPixels = ImageBuffer<Rgba<u8>, HostBytes>;

/// A block of host memory lent for as long as it is held, its first `len` bytes in use;
/// dropping it gives the block back to its allocator.
pub trait Lease: Send + Sync {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// Where `HostBytes` come from.
pub trait HostAlloc: Send + Sync {
    /// `len` bytes, leased where the allocator can and on the heap otherwise. What they
    /// hold is unspecified (a leased block keeps its last user's bytes): the caller writes
    /// all of them before reading any.
    fn alloc(&self, len: usize) -> HostBytes;
}

/// The heap, for every request: where no GPU serves, and in tests.
#[derive(Debug, Clone, Copy, Default)]
pub struct Heap;

impl HostAlloc for Heap {
    fn alloc(&self, len: usize) -> HostBytes {
        HostBytes::from(vec![0; len])
    }
}

/// The allocator a server's requests use, shared by the decoders and the replicas.
pub type SharedAlloc = Arc<dyn HostAlloc>;

/// The heap as a `SharedAlloc`.
pub fn heap() -> SharedAlloc {
    Arc::new(Heap)
}

/// Pixel bytes on the host: a heap vector, or a leased block.
pub struct HostBytes(Inner);

enum Inner {
    Heap(Vec<u8>),
    Leased(Box<dyn Lease>),
}

impl HostBytes {
    pub fn leased(lease: Box<dyn Lease>) -> Self {
        Self(Inner::Leased(lease))
    }

    /// Whether the bytes are a leased block (page-locked, where a GPU pool lent them).
    pub fn is_leased(&self) -> bool {
        matches!(self.0, Inner::Leased(_))
    }

    /// The bytes as a vector: free for heap bytes, a copy of a leased block's.
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            Inner::Heap(v) => v,
            Inner::Leased(lease) => lease.bytes().to_vec(),
        }
    }
}

impl From<Vec<u8>> for HostBytes {
    fn from(v: Vec<u8>) -> Self {
        Self(Inner::Heap(v))
    }
}

impl Deref for HostBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Inner::Heap(v) => v,
            Inner::Leased(lease) => lease.bytes(),
        }
    }
}

impl DerefMut for HostBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Inner::Heap(v) => v,
            Inner::Leased(lease) => lease.bytes_mut(),
        }
    }
}

/// A copy on the heap: a lease is lent once.
impl Clone for HostBytes {
    fn clone(&self) -> Self {
        Self::from(self.to_vec())
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_leased() { "leased" } else { "heap" };
        write!(f, "HostBytes({kind}, {} bytes)", self.len())
    }
}

/// An image's pixels as `HostBytes`, without a copy.
pub fn from_image<P: image::Pixel<Subpixel = u8>>(
    image: ImageBuffer<P, Vec<u8>>,
) -> ImageBuffer<P, HostBytes> {
    let (w, h) = image.dimensions();
    ImageBuffer::from_raw(w, h, HostBytes::from(image.into_raw()))
        .expect("an image's own buffer holds its pixels")
}

/// An image's pixels as a heap vector (a copy only if they were leased).
pub fn into_image<P: image::Pixel<Subpixel = u8>>(
    image: ImageBuffer<P, HostBytes>,
) -> ImageBuffer<P, Vec<u8>> {
    let (w, h) = image.dimensions();
    ImageBuffer::from_raw(w, h, image.into_raw().into_vec())
        .expect("an image's own buffer holds its pixels")
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Block(Vec<u8>, usize);

    impl Lease for Block {
        fn bytes(&self) -> &[u8] {
            &self.0[..self.1]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.0[..self.1]
        }
    }

    #[test]
    fn a_leased_block_shows_only_its_length_and_clones_to_the_heap() {
        let mut bytes = HostBytes::leased(Box::new(Block(vec![7; 16], 6)));
        assert_eq!(bytes.len(), 6);
        bytes[5] = 1;
        assert!(bytes.is_leased());
        let copy = bytes.clone();
        assert!(!copy.is_leased());
        assert_eq!(&copy[..], &[7, 7, 7, 7, 7, 1]);
        assert_eq!(bytes.into_vec(), vec![7, 7, 7, 7, 7, 1]);
    }

    #[test]
    fn images_move_between_heap_vectors_and_host_bytes_whole() {
        let image = image::RgbImage::from_fn(3, 2, |x, y| Rgb([x as u8, y as u8, 9]));
        let pixels = from_image(image.clone());
        assert_eq!(pixels.get_pixel(2, 1), &Rgb([2, 1, 9]));
        assert_eq!(into_image(pixels), image);
    }
}
