//! Host memory for a request's pixels: the decoded image a device reads and the planes
//! it hands back, from the decoder's writes to the encoder's reads without a copy in
//! between. `HostBytes` is either an ordinary heap vector or a block leased from an
//! allocator (`HostAlloc`): where GPUs serve, a pool of page-locked blocks
//! (`crate::cuda::host_pool`), which a GPU's copies read and write as DMA; on the CPU
//! alone, the heap, its large blocks kept for the next request (`RecyclingHeap`). The
//! ground floor: imports nothing of celer's.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

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

    /// Gives back to the system what the allocator keeps for later requests (the server
    /// went idle). Nothing, unless it keeps something.
    fn release_kept(&self) {}
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

/// The heap, its large blocks kept when freed and lent again, as a `SharedAlloc`: what
/// the CPU serves from. `reserve`: see `RecyclingHeap::with_reserve`.
pub fn recycling_heap(reserve: Reserve) -> SharedAlloc {
    Arc::new(RecyclingHeap::with_reserve(reserve))
}

/// Blocks a `RecyclingHeap` makes at start-up and keeps for the server's life: for each
/// size an image is expected at (`--warmup-size`), the blocks of `requests` requests of
/// that size (its RGB8 pixels, and the alpha and trimap a CPU replica hands back), those
/// of `RECYCLE_FROM` or more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reserve {
    /// (bytes, blocks), one entry a size.
    pub blocks: Vec<(usize, usize)>,
}

impl Reserve {
    /// The blocks of `requests` requests at each of `sizes` (width, height).
    pub fn for_sizes(sizes: &[(u32, u32)], requests: usize) -> Self {
        let mut blocks: Vec<(usize, usize)> = Vec::new();
        for &(w, h) in sizes {
            let pixels = w as usize * h as usize;
            for (len, count) in [(3 * pixels, requests), (pixels, 2 * requests)] {
                if len < RECYCLE_FROM || count == 0 {
                    continue;
                }
                match blocks.iter_mut().find(|b| b.0 == len) {
                    Some(b) => b.1 = b.1.max(count),
                    None => blocks.push((len, count)),
                }
            }
        }
        Self { blocks }
    }

    pub fn bytes(&self) -> usize {
        self.blocks.iter().map(|(len, n)| len * n).sum()
    }
}

/// Blocks from this size up are kept for reuse: a 1080p photo's pixels (6.2 MB) and
/// larger. Smaller ones stay with the allocator, which keeps them in its thread heaps.
pub const RECYCLE_FROM: usize = 4 << 20;

/// The heap, with its large blocks (`RECYCLE_FROM` and up) kept when freed and lent again
/// to the next request of about their size, from any thread.
///
/// Why: a request's image is decoded on one thread and freed on another (a replica's, or
/// the encoder's), and mimalloc did not lend the freed blocks to the next decode: with
/// its purge delay at 10 minutes, `perf` still put 2.7 % of all CPU time (past a run's
/// first 15 s, mixed 320x320 and 12 MP traffic on 2 cores) in the kernel zeroing fresh
/// huge pages under the decoder's writes, 1.2 % with this heap. On this project's VMs
/// such faults are slow: while 12 MP requests came together the kernel took up to 85 %
/// of both cores, and requests admitted on their price missed their deadline
/// (docs/decisions.md, "Memory kept between requests").
///
/// The same rule as ONNX Runtime's block cache (`crate::ort::block_cache`): the blocks
/// kept plus those in use never exceed the most that was ever in use at once, so what is
/// kept is what the traffic has shown it needs. A miss gives back kept blocks, oldest
/// first, until the new block fits under that mark. A block is lent again by best fit, up
/// to an eighth larger than asked. What is kept goes back to the system when the server
/// goes idle (`release_kept`).
///
/// Beside those, a reserve (`with_reserve`): blocks made and written once at start-up,
/// before the server is ready, lent first and never given back. The rule above lets the
/// heap grow only when the traffic first needs a block more, and on these VMs that first
/// write of 37 MB (a 12 MP photo) was a burst of the kernel's time: at a 1.5 s deadline,
/// each of the heap's new blocks past the first seconds came with admitted requests that
/// expired (docs/decisions.md, "Memory kept between requests").
#[derive(Default)]
pub struct RecyclingHeap {
    books: Arc<Mutex<Kept>>,
}

/// The blocks kept, and the books of the blocks lent (their bytes in use, kept and at
/// most in use, and the counts).
#[derive(Default)]
struct Kept {
    /// Oldest first; each block's length is its size.
    free: Vec<Vec<u8>>,
    /// The reserve's blocks not lent now.
    reserve: Vec<Vec<u8>>,
    stats: RecycleStats,
}

/// The heap's books: counts since the start, and the bytes in use and kept now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RecycleStats {
    /// Blocks lent again.
    pub reused: u64,
    /// Blocks made afresh.
    pub made: u64,
    /// Kept blocks given back to the system.
    pub released: u64,
    /// Of the blocks outside the reserve, those lent now and those kept.
    pub in_use_bytes: usize,
    pub kept_bytes: usize,
    /// The most bytes ever in use at once outside the reserve.
    pub high_water_bytes: usize,
    /// The reserve's bytes, lent or not.
    pub reserve_bytes: usize,
    /// Blocks lent from the reserve.
    pub reserve_lent: u64,
}

fn lock(books: &Mutex<Kept>) -> MutexGuard<'_, Kept> {
    // The books stay consistent between statements: a panic elsewhere leaves them usable.
    books.lock().unwrap_or_else(|p| p.into_inner())
}

/// The smallest of `blocks` of `len` bytes up to an eighth more, taken out.
fn best_fit(blocks: &mut Vec<Vec<u8>>, len: usize) -> Option<Vec<u8>> {
    let most = len + len / 8;
    let (index, _) = blocks
        .iter()
        .enumerate()
        .filter(|(_, b)| (len..=most).contains(&b.len()))
        .min_by_key(|(_, b)| b.len())?;
    Some(blocks.remove(index))
}

/// `len` bytes on the heap, each page written: faulted in now rather than by the first
/// request that writes them.
fn written_block(len: usize) -> Vec<u8> {
    let mut block = vec![0u8; len];
    // Ones, not zeros: a zero written to memory fresh from the allocator's zeroed pages
    // is a store the compiler may drop.
    block.iter_mut().step_by(4096).for_each(|b| *b = 1);
    std::hint::black_box(block)
}

impl Kept {
    /// A kept block for `len` bytes (the reserve's first), and whether it is the
    /// reserve's.
    fn take(&mut self, len: usize) -> Option<(Vec<u8>, bool)> {
        if let Some(block) = best_fit(&mut self.reserve, len) {
            self.stats.reserve_lent += 1;
            return Some((block, true));
        }
        let block = best_fit(&mut self.free, len)?;
        self.stats.kept_bytes -= block.len();
        Some((block, false))
    }

    /// The kept blocks to give back, oldest first, so that a new block of `len` bytes
    /// fits under the high-water mark (or raises it, when the blocks in use alone do).
    fn make_room(&mut self, len: usize) -> Vec<Vec<u8>> {
        let mark = self
            .stats
            .high_water_bytes
            .max(self.stats.in_use_bytes + len);
        let mut released = Vec::new();
        while self.stats.in_use_bytes + self.stats.kept_bytes + len > mark && !self.free.is_empty()
        {
            let block = self.free.remove(0);
            self.stats.kept_bytes -= block.len();
            released.push(block);
        }
        self.stats.released += released.len() as u64;
        released
    }

    fn lent(&mut self, len: usize) {
        self.stats.in_use_bytes += len;
        self.stats.high_water_bytes = self.stats.high_water_bytes.max(self.stats.in_use_bytes);
    }
}

impl RecyclingHeap {
    /// A heap whose reserve is made now, every page written, so that no request faults
    /// it in.
    pub fn with_reserve(reserve: Reserve) -> Self {
        let mut kept = Kept::default();
        for &(len, count) in &reserve.blocks {
            kept.reserve.extend((0..count).map(|_| written_block(len)));
        }
        kept.stats.reserve_bytes = reserve.bytes();
        Self {
            books: Arc::new(Mutex::new(kept)),
        }
    }

    pub fn stats(&self) -> RecycleStats {
        lock(&self.books).stats
    }
}

impl HostAlloc for RecyclingHeap {
    fn alloc(&self, len: usize) -> HostBytes {
        if len < RECYCLE_FROM {
            return Heap.alloc(len);
        }
        let mut books = lock(&self.books);
        let (block, reserved) = match books.take(len) {
            Some((block, reserved)) => {
                books.stats.reused += 1;
                (block, reserved)
            }
            None => {
                let released = books.make_room(len);
                books.stats.made += 1;
                let stats = books.stats;
                drop(books);
                tracing::debug!(
                    len,
                    released = released.len(),
                    in_use = stats.in_use_bytes,
                    kept = stats.kept_bytes,
                    high_water = stats.high_water_bytes,
                    "pixel block made"
                );
                // Freed and made outside the lock: each may take the kernel a while.
                drop(released);
                let block = vec![0; len];
                books = lock(&self.books);
                (block, false)
            }
        };
        if !reserved {
            books.lent(block.len());
        }
        drop(books);
        HostBytes::leased(Box::new(Recycled {
            block,
            len,
            reserved,
            home: self.books.clone(),
        }))
    }

    /// The reserve stays.
    fn release_kept(&self) {
        let mut books = lock(&self.books);
        let released = std::mem::take(&mut books.free);
        let bytes = std::mem::take(&mut books.stats.kept_bytes);
        books.stats.released += released.len() as u64;
        let stats = books.stats;
        drop(books);
        if !released.is_empty() {
            tracing::debug!(
                blocks = released.len(),
                bytes,
                high_water = stats.high_water_bytes,
                made = stats.made,
                reused = stats.reused,
                "pixel blocks given back"
            );
        }
        drop(released);
    }
}

/// A block lent by a `RecyclingHeap`, its first `len` bytes in use; kept again when
/// dropped.
struct Recycled {
    block: Vec<u8>,
    len: usize,
    /// The reserve's: it goes back there.
    reserved: bool,
    home: Arc<Mutex<Kept>>,
}

impl Lease for Recycled {
    fn bytes(&self) -> &[u8] {
        &self.block[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.block[..self.len]
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let block = std::mem::take(&mut self.block);
        let mut books = lock(&self.home);
        if self.reserved {
            books.reserve.push(block);
            return;
        }
        books.stats.in_use_bytes -= block.len();
        books.stats.kept_bytes += block.len();
        books.free.push(block);
    }
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

    /// Whether the bytes are a leased block (page-locked, where a GPU pool lent them; kept
    /// for reuse, where a `RecyclingHeap` did).
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

/// Equal when their bytes are, wherever they live.
impl PartialEq for HostBytes {
    fn eq(&self, other: &Self) -> bool {
        self[..] == other[..]
    }
}

impl Eq for HostBytes {}

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

    const MIB: usize = 1 << 20;

    #[test]
    fn a_recycling_heap_lends_a_freed_large_block_again_and_leaves_small_ones_to_the_heap() {
        let heap = RecyclingHeap::default();
        assert!(!heap.alloc(RECYCLE_FROM - 1).is_leased());
        let mut first = heap.alloc(8 * MIB);
        assert!(first.is_leased());
        assert_eq!(first.len(), 8 * MIB);
        first[0] = 7;
        let address = first.as_ptr();
        drop(first);
        assert_eq!(heap.stats().kept_bytes, 8 * MIB);
        // Less than an eighth smaller than the block still fits it; its bytes are the
        // last user's.
        let again = heap.alloc(8 * MIB - MIB / 2);
        assert_eq!(
            (again.as_ptr(), again.len(), again[0]),
            (address, 8 * MIB - MIB / 2, 7)
        );
        let stats = heap.stats();
        assert_eq!((stats.made, stats.reused), (1, 1));
        assert_eq!((stats.in_use_bytes, stats.kept_bytes), (8 * MIB, 0));
        // Lent and dropped on another thread, it comes back all the same.
        std::thread::spawn(move || drop(again)).join().unwrap();
        assert_eq!(heap.stats().kept_bytes, 8 * MIB);
    }

    #[test]
    fn a_recycling_heap_keeps_no_more_than_was_ever_in_use_at_once() {
        let heap = RecyclingHeap::default();
        let (a, b) = (heap.alloc(8 * MIB), heap.alloc(8 * MIB));
        drop((a, b));
        // 16 MiB kept, the high-water mark. A block too small for either (more than an
        // eighth under) is made afresh, and one kept block is given back for it.
        let small = heap.alloc(5 * MIB);
        let stats = heap.stats();
        assert_eq!((stats.made, stats.reused, stats.released), (3, 0, 1));
        assert_eq!((stats.in_use_bytes, stats.kept_bytes), (5 * MIB, 8 * MIB));
        // More than any kept block: made afresh, and the mark (16 MiB) leaves room for it
        // only without the other kept block.
        let big = heap.alloc(11 * MIB);
        let stats = heap.stats();
        assert_eq!((stats.made, stats.released), (4, 2));
        assert_eq!((stats.in_use_bytes, stats.kept_bytes), (16 * MIB, 0));
        drop((small, big));
        assert_eq!(heap.stats().kept_bytes, 16 * MIB);
        heap.release_kept();
        let stats = heap.stats();
        assert_eq!((stats.kept_bytes, stats.released), (0, 4));
    }

    #[test]
    fn a_recycling_heaps_reserve_is_made_at_once_lent_first_and_kept_when_idle() {
        let heap = RecyclingHeap::with_reserve(Reserve {
            blocks: vec![(8 * MIB, 2)],
        });
        let stats = heap.stats();
        assert_eq!(
            (stats.reserve_bytes, stats.made, stats.kept_bytes),
            (16 * MIB, 0, 0)
        );
        // Two blocks the size of the reserve's, or up to an eighth smaller: the reserve's.
        let (a, b) = (heap.alloc(8 * MIB), heap.alloc(8 * MIB - MIB / 2));
        assert!(a.is_leased() && b.is_leased());
        let stats = heap.stats();
        assert_eq!(
            (stats.reserve_lent, stats.made, stats.in_use_bytes),
            (2, 0, 0)
        );
        // A third is made, and follows the rule of the blocks outside the reserve.
        let c = heap.alloc(8 * MIB);
        let stats = heap.stats();
        assert_eq!((stats.made, stats.in_use_bytes), (1, 8 * MIB));
        drop((a, b, c));
        heap.release_kept();
        let stats = heap.stats();
        assert_eq!((stats.released, stats.kept_bytes), (1, 0));
        // The reserve stayed: the next two blocks are its own, the third is made.
        let again = [
            heap.alloc(8 * MIB),
            heap.alloc(8 * MIB),
            heap.alloc(8 * MIB),
        ];
        let stats = heap.stats();
        assert_eq!((stats.reserve_lent, stats.made), (4, 2));
        drop(again);
    }

    #[test]
    fn a_reserve_holds_each_sizes_image_alpha_and_trimap_where_they_are_large() {
        let reserve = Reserve::for_sizes(&[(320, 320), (4032, 3024), (4032, 3024)], 2);
        let pixels = 4032 * 3024;
        assert_eq!(reserve.blocks, vec![(3 * pixels, 2), (pixels, 4)]);
        assert_eq!(reserve.bytes(), 10 * pixels);
        // 1080p: the image is large enough, its planes (2 MB) are not.
        let hd = Reserve::for_sizes(&[(1920, 1080)], 3);
        assert_eq!(hd.blocks, vec![(3 * 1920 * 1080, 3)]);
        assert!(Reserve::for_sizes(&[(4032, 3024)], 0).blocks.is_empty());
    }

    #[test]
    fn images_move_between_heap_vectors_and_host_bytes_whole() {
        let image = image::RgbImage::from_fn(3, 2, |x, y| Rgb([x as u8, y as u8, 9]));
        let pixels = from_image(image.clone());
        assert_eq!(pixels.get_pixel(2, 1), &Rgb([2, 1, 9]));
        assert_eq!(into_image(pixels), image);
    }
}
