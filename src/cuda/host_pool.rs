//! Page-locked host blocks for requests' pixels, lent to the decoders (the image a GPU
//! uploads) and to the GPU replicas (the planes they download and the encoders read), so
//! that each copy across the bus is DMA straight from the decoder's output or into the
//! encoder's input, with no staging copy on either side.
//!
//! The blocks are celer's own heap memory, page-aligned, page-locked with
//! `cuMemHostRegister` (PORTABLE: DMA for every GPU) rather than allocated by the driver:
//! requests hold their blocks across the router, the queue and the encoder, beyond any one
//! context, and a GPU's context may be destroyed and made again (recovery) while they do.
//! A registration ends with the context it was made in, for every GPU, so the pool
//! registers in a context of its own (`OwnContext`, made on the first GPU to open, kept for
//! the pool's life) that no recovery resets: a reset of GPU 0's primary context would
//! otherwise make GPU 1's copies from the pool pageable. Where that context cannot be made
//! (a GPU that allows one context per process), each GPU's own context registers, as a
//! fallback. A copy from memory that is not page-locked is still correct (the driver
//! stages it), only slower and synchronous.
//!
//! Sized at start-up (`HostPool::new`); a lease the free blocks cannot serve gets the heap
//! at once, and a thread of the pool's pins one block more in the background, up to the
//! pool's ceiling: pinning takes milliseconds, so never on the request path.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::driver::{code, sys, CudaContext, DriverError, OwnContext};

use crate::pixels::{Heap, HostAlloc, HostBytes, Lease};

/// Blocks are whole pages: page-locking works page by page.
const PAGE: usize = 4096;

/// One page-aligned heap allocation, zeroed when made.
struct Block {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Block` owns its allocation alone (no other pointer to it is kept), so it may
// move between threads and be shared read-only as a `Vec<u8>` may.
unsafe impl Send for Block {}
// SAFETY: as above: `&Block` gives only shared slices.
unsafe impl Sync for Block {}

impl Block {
    fn new(len: usize) -> Option<Self> {
        let len = len.max(1).next_multiple_of(PAGE);
        let layout = Layout::from_size_align(len, PAGE).ok()?;
        // SAFETY: `layout` has a non-zero size. Zeroed, so every byte is initialised
        // before any slice of it exists.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(Self { ptr, len })
    }

    fn address(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes for as long as `self` owns
        // the allocation; `&self` allows only shared access.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, PAGE).expect("the layout it was made with");
        // SAFETY: allocated in `Block::new` with this layout, freed once, here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// A context the pool's blocks are page-locked in.
enum Locker<'a> {
    /// The pool's own: every block, for every GPU, whatever GPU recovers.
    Own(&'a OwnContext),
    /// A GPU's primary context (the fallback), while it lives.
    Gpu(Arc<CudaContext>),
}

impl Locker<'_> {
    /// Page-locks `(address, len)` here. Memory already page-locked (by another GPU's
    /// context: registrations are portable across contexts) counts as done.
    fn register(&self, address: usize, len: usize) -> Result<(), DriverError> {
        let (pointer, flags) = (
            address as *mut std::ffi::c_void,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        );
        // SAFETY: the range is a live `Block` of the pool, which outlives its registration:
        // blocks are unregistered (`Shared::drop`) before they are freed, and the own
        // context goes with the registry, before the blocks. The driver only marks the
        // pages page-locked; it does not write them.
        let registered = unsafe {
            match self {
                Locker::Own(own) => own.register_host(pointer, len, flags),
                Locker::Gpu(context) => context.register_host(pointer, len, flags),
            }
        };
        match registered {
            Err(e) if e.code() == Some(code::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) => Ok(()),
            other => other,
        }
    }

    /// Ends the registration of the block at `address`. An error (not registered here)
    /// changes nothing.
    ///
    /// # Safety
    /// No copy from or to the block may be queued.
    unsafe fn unregister(&self, address: usize) {
        let pointer = address as *mut std::ffi::c_void;
        // SAFETY: forwarded to the caller.
        let _ = unsafe {
            match self {
                Locker::Own(own) => own.unregister_host(pointer),
                Locker::Gpu(context) => context.unregister_host(pointer),
            }
        };
    }
}

/// `Locker::register`, a failure logged: the block still serves, its copies staged by the
/// driver.
fn register_or_warn(locker: &Locker<'_>, address: usize, len: usize) {
    if let Err(e) = locker.register(address, len) {
        tracing::warn!(
            error = %e,
            bytes = len,
            "cannot page-lock a pixel block: its copies go through the driver's staging"
        );
    }
}

/// What the pool has made and where it is registered.
struct Registry {
    /// Every block's `(address, len)`, lent or free.
    blocks: Vec<(usize, usize)>,
    /// The pool's own context, every block page-locked in it: made at the first GPU's
    /// `attach`, kept until the pool goes.
    own: Option<OwnContext>,
    /// Where no own context could be made: the GPUs' contexts the blocks are page-locked
    /// in, while they live.
    contexts: Vec<Weak<CudaContext>>,
    bytes: usize,
}

impl Registry {
    fn live_contexts(&mut self) -> Vec<Arc<CudaContext>> {
        self.contexts.retain(|c| c.strong_count() > 0);
        self.contexts.iter().filter_map(Weak::upgrade).collect()
    }

    /// Where a block is page-locked: the own context, else each live GPU context.
    fn lockers(&mut self) -> Vec<Locker<'_>> {
        if self.own.is_none() {
            return self.live_contexts().into_iter().map(Locker::Gpu).collect();
        }
        self.own.iter().map(Locker::Own).collect()
    }

    /// Makes the own context on `context`'s GPU and page-locks every block in it, unless
    /// blocks are already page-locked in a live GPU context (the fallback, which stays).
    fn make_own(&mut self, context: &CudaContext) {
        if self.own.is_some() || !self.live_contexts().is_empty() {
            return;
        }
        match OwnContext::create(context.device()) {
            Ok(own) => {
                for &(address, len) in &self.blocks {
                    register_or_warn(&Locker::Own(&own), address, len);
                }
                self.own = Some(own);
            }
            Err(error) => tracing::warn!(
                gpu = context.ordinal(),
                %error,
                "cannot make the pixel pool a context of its own: its blocks are page-locked in \
                 each GPU's context, and a recovery that resets one makes them pageable"
            ),
        }
    }
}

struct Shared {
    free: Mutex<Vec<Block>>,
    registry: Mutex<Registry>,
    /// The size of the blocks made at start-up, and the least a grown one gets.
    block_bytes: usize,
    /// No more than this is pinned, grown blocks included.
    max_bytes: usize,
    growing: AtomicBool,
    leases: AtomicU64,
    misses: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while a lock was held leaves the lists whole: each change is one push or
    // one removal.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Makes a block of `len` bytes, page-locks it in every live context, and adds it to
    /// the free list.
    fn add_block(&self, len: usize) -> bool {
        let Some(block) = Block::new(len) else {
            return false;
        };
        let mut registry = lock(&self.registry);
        for locker in registry.lockers() {
            register_or_warn(&locker, block.address(), block.len);
        }
        registry.blocks.push((block.address(), block.len));
        registry.bytes += block.len;
        drop(registry);
        lock(&self.free).push(block);
        true
    }

    /// The smallest free block that holds `len` bytes.
    fn take(&self, len: usize) -> Option<Block> {
        let mut free = lock(&self.free);
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len >= len)
            .min_by_key(|(_, b)| b.len)
            .map(|(i, _)| i)?;
        Some(free.swap_remove(best))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Every lease holds the pool, so every block is free now and no copy uses one.
        let registry = self.registry.get_mut().unwrap_or_else(|p| p.into_inner());
        let blocks = registry.blocks.clone();
        for locker in registry.lockers() {
            for &(address, _) in &blocks {
                // SAFETY: `address` is the base of a block registered above and still
                // allocated (blocks are freed after this), and no copy uses it (every
                // block is free).
                unsafe { locker.unregister(address) };
            }
        }
        // The own context goes here (its Drop destroys it), before the blocks.
        registry.own = None;
    }
}

/// The pool: cheap to clone, shared by a server's decoders and GPU replicas.
#[derive(Clone)]
pub struct HostPool {
    shared: Arc<Shared>,
}

/// How a pool has served so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Host memory the pool holds, page-locked or to be.
    pub bytes: usize,
    pub blocks: usize,
    /// Leases served from a block.
    pub leases: u64,
    /// Leases no free block could serve, given the heap.
    pub misses: u64,
}

impl HostPool {
    /// `blocks` blocks of `block_bytes` now; growing to at most `max_bytes`.
    pub fn new(blocks: usize, block_bytes: usize, max_bytes: usize) -> Self {
        Self::with_blocks(&vec![block_bytes; blocks], max_bytes)
    }

    /// A block of each of `sizes` bytes now (rounded up to whole pages); growing to at
    /// most `max_bytes`. A grown block is at least as large as the smallest of `sizes`.
    pub fn with_blocks(sizes: &[usize], max_bytes: usize) -> Self {
        let page = |len: usize| len.max(1).next_multiple_of(PAGE);
        let block_bytes = sizes.iter().copied().map(page).min().unwrap_or(PAGE);
        let made = sizes
            .iter()
            .copied()
            .map(page)
            .fold(0, usize::saturating_add);
        let shared = Arc::new(Shared {
            free: Mutex::new(Vec::with_capacity(sizes.len())),
            registry: Mutex::new(Registry {
                blocks: Vec::new(),
                own: None,
                contexts: Vec::new(),
                bytes: 0,
            }),
            block_bytes,
            max_bytes: max_bytes.max(made),
            growing: AtomicBool::new(false),
            leases: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        });
        for &len in sizes {
            if !shared.add_block(page(len)) {
                tracing::warn!(block_bytes = len, "cannot allocate a pixel block");
                break;
            }
        }
        Self { shared }
    }

    /// A GPU just opened, or reopened, in `context`: the first makes the pool's own
    /// context on its GPU and page-locks every block there (DMA for every GPU from then
    /// on); where that cannot be made, every block, and each made later, is page-locked in
    /// `context`. Takes milliseconds a block: at a GPU's load, never per request.
    pub fn attach(&self, context: &Arc<CudaContext>) {
        let mut registry = lock(&self.shared.registry);
        registry.make_own(context);
        if registry.own.is_some() {
            return;
        }
        let locker = Locker::Gpu(context.clone());
        for &(address, len) in &registry.blocks {
            register_or_warn(&locker, address, len);
        }
        registry.contexts.retain(|c| c.strong_count() > 0);
        registry.contexts.push(Arc::downgrade(context));
    }

    /// Page-locks nothing more in `context`, without a call in it: its GPU was lost for
    /// good, and no call is made there again (its registrations go with the process).
    /// The pool's own context, when it is on that GPU, goes the same way: never called
    /// again, not even to be destroyed, so its registrations hold until the process ends
    /// (the other GPUs' copies stay DMA); blocks grown after it are not page-locked.
    pub fn detach(&self, context: &Arc<CudaContext>) {
        let mut registry = lock(&self.shared.registry);
        registry
            .contexts
            .retain(|c| c.strong_count() > 0 && !std::ptr::eq(c.as_ptr(), Arc::as_ptr(context)));
        if registry
            .own
            .as_ref()
            .is_some_and(|own| own.ordinal() == context.ordinal())
        {
            std::mem::forget(registry.own.take());
        }
    }

    pub fn stats(&self) -> PoolStats {
        let registry = lock(&self.shared.registry);
        PoolStats {
            bytes: registry.bytes,
            blocks: registry.blocks.len(),
            leases: self.shared.leases.load(Ordering::Relaxed),
            misses: self.shared.misses.load(Ordering::Relaxed),
        }
    }

    /// Asks the pool's thread for a block that holds `len` bytes and half as much again
    /// (so that a run of slightly larger images pins once), unless one is being made or
    /// the ceiling is reached.
    fn grow(&self, len: usize) {
        let shared = &self.shared;
        let size = (len + len / 2)
            .max(shared.block_bytes)
            .next_multiple_of(PAGE);
        if lock(&shared.registry).bytes + size > shared.max_bytes {
            return;
        }
        if shared.growing.swap(true, Ordering::AcqRel) {
            return;
        }
        let grower = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("celer-pin".into())
            .spawn(move || {
                grower.add_block(size);
                grower.growing.store(false, Ordering::Release);
            });
        if spawned.is_err() {
            shared.growing.store(false, Ordering::Release);
        }
    }
}

impl HostAlloc for HostPool {
    fn alloc(&self, len: usize) -> HostBytes {
        match self.shared.take(len) {
            Some(block) => {
                self.shared.leases.fetch_add(1, Ordering::Relaxed);
                HostBytes::leased(Box::new(PoolLease {
                    block: Some(block),
                    len,
                    pool: self.shared.clone(),
                }))
            }
            None => {
                self.shared.misses.fetch_add(1, Ordering::Relaxed);
                self.grow(len);
                Heap.alloc(len)
            }
        }
    }
}

/// A block lent by the pool, its first `len` bytes in use; back in the pool when dropped.
struct PoolLease {
    /// Always `Some` until dropped.
    block: Option<Block>,
    len: usize,
    pool: Arc<Shared>,
}

impl Lease for PoolLease {
    fn bytes(&self) -> &[u8] {
        match &self.block {
            Some(block) => &block.as_slice()[..self.len],
            None => &[],
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.block {
            Some(block) => &mut block.as_mut_slice()[..self.len],
            None => &mut [],
        }
    }
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            lock(&self.pool.free).push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_come_back_and_the_smallest_block_that_fits_is_lent() {
        let pool = HostPool::new(2, 10_000, 0);
        let big = pool.alloc(9_000);
        assert!(big.is_leased());
        assert_eq!(big.len(), 9_000);
        let small = pool.alloc(100);
        assert!(small.is_leased());
        // Both lent: the heap, and a block asked for in the background.
        let third = pool.alloc(100);
        assert!(!third.is_leased());
        drop(big);
        let again = pool.alloc(5_000);
        assert!(again.is_leased());
        let stats = pool.stats();
        assert_eq!((stats.leases, stats.misses), (3, 1));
        // The ceiling (two blocks) holds: nothing grew.
        assert_eq!(stats.blocks, 2);
    }

    #[test]
    fn a_miss_grows_the_pool_in_the_background_up_to_its_ceiling() {
        let pool = HostPool::new(1, PAGE, 4 * PAGE);
        let held = pool.alloc(PAGE);
        let missed = pool.alloc(2 * PAGE);
        assert!(!missed.is_leased());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pool.stats().blocks < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Half as much again as the miss asked for: three pages.
        assert_eq!((pool.stats().blocks, pool.stats().bytes), (2, 4 * PAGE));
        let grown = pool.alloc(2 * PAGE);
        assert!(grown.is_leased());
        // At the ceiling: another miss stays on the heap, and nothing grows.
        assert!(!pool.alloc(PAGE).is_leased());
        drop((held, grown));
        assert_eq!(pool.stats().blocks, 2);
    }
}
