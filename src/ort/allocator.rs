//! The CPU allocator that ONNX Runtime's sessions share: an `OrtAllocator` registered in
//! the environment, whose blocks go through `block_cache`'s books. Sessions opt in with
//! `session.use_env_allocators`. FFI only: the policy lives in `block_cache`.
//!
//! The blocks come from the C library's `posix_memalign`, as ONNX Runtime's own CPU
//! allocator's do, not from the binary's global allocator (mimalloc keeps freed pages a
//! while): a block given back is unmapped at once when large (src/main.rs sets glibc's
//! threshold), so giving the cache back lowers the RSS when it happens.

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Mutex, MutexGuard, OnceLock};

use ort::sys::{OrtAllocator, OrtAllocatorType, OrtMemType, OrtMemoryInfo, OrtStatusPtr};
use ort::AsPointer;

use super::block_cache::{Block, BlockCache, CacheStats, Take, BLOCK_ALIGN};
use super::OrtError;

static CACHE: Mutex<BlockCache> = Mutex::new(BlockCache::new());

/// The allocator ONNX Runtime calls back: its table first, as the C API requires.
#[repr(C)]
struct CachingAllocator {
    table: OrtAllocator,
    info: *const OrtMemoryInfo,
}

/// Whether the allocator is registered: once per process, since the environment is.
static REGISTERED: OnceLock<Result<(), OrtError>> = OnceLock::new();

fn cache() -> MutexGuard<'static, BlockCache> {
    // A panic never happens under this lock (no call in it can panic), but a poisoned
    // lock still holds consistent books.
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

extern "C" {
    fn posix_memalign(out: *mut *mut c_void, alignment: usize, size: usize) -> c_int;
    fn free(ptr: *mut c_void);
}

fn unmap(blocks: Vec<Block>) {
    for block in blocks {
        // SAFETY: every block in the books came from posix_memalign below and is no
        // longer handed out (it was cached), so nothing refers to it.
        unsafe { free(block.addr as *mut c_void) };
    }
}

unsafe extern "system" fn alloc(_this: *mut OrtAllocator, bytes: usize) -> *mut c_void {
    // The books under the lock; the system calls outside it, so that a replica giving the
    // cache back never waits on them.
    let (size, release) = match cache().take(bytes) {
        Take::Reuse(block) => return block.addr as *mut c_void,
        Take::Map { size, release } => (size, release),
    };
    unmap(release);
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: posix_memalign writes a block of `size` bytes (non-zero: block_size rounds
    // 0 up) to `ptr`, or returns an error and leaves it null.
    let failed = unsafe { posix_memalign(&mut ptr, BLOCK_ALIGN, size) } != 0 || ptr.is_null();
    let mut books = cache();
    if failed {
        books.map_failed(size);
        return std::ptr::null_mut();
    }
    books.mapped(ptr as usize, size);
    ptr
}

unsafe extern "system" fn reserve(this: *const OrtAllocator, bytes: usize) -> *mut c_void {
    // SAFETY: `alloc` does not write through `this`; the cast only matches its signature.
    unsafe { alloc(this.cast_mut(), bytes) }
}

unsafe extern "system" fn give_back(_this: *mut OrtAllocator, ptr: *mut c_void) {
    if !ptr.is_null() && cache().give_back(ptr as usize).is_none() {
        // Not a block of ours: leaking it is safer than freeing with a guessed layout.
        tracing::error!(?ptr, "ONNX Runtime freed a block this allocator never gave");
    }
}

unsafe extern "system" fn memory_info(this: *const OrtAllocator) -> *const OrtMemoryInfo {
    // SAFETY: ONNX Runtime passes back the pointer it was registered with, which points at
    // the `table` field, first in a `CachingAllocator` (repr(C)).
    unsafe { (*this.cast::<CachingAllocator>()).info }
}

/// Turns a C API status into a Result, releasing it.
fn check(status: OrtStatusPtr, what: &str) -> Result<(), OrtError> {
    if status.0.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status from the C API carries a message until it is released,
    // and is released exactly once here.
    let message = unsafe {
        let message = CStr::from_ptr((ort::api().GetErrorMessage)(status.0))
            .to_string_lossy()
            .into_owned();
        (ort::api().ReleaseStatus)(status.0);
        message
    };
    Err(OrtError::Environment(format!("{what}: {message}")))
}

/// Registers the caching allocator in `env` (once per process; later calls return the
/// first outcome).
pub fn register(env: &ort::environment::Environment) -> Result<(), OrtError> {
    let registered = REGISTERED.get_or_init(|| {
        let mut info: *mut OrtMemoryInfo = std::ptr::null_mut();
        check(
            // SAFETY: CreateCpuMemoryInfo writes a new memory info to `info`; it is kept for
            // the process's life (the registered allocator returns it).
            unsafe {
                (ort::api().CreateCpuMemoryInfo)(
                    OrtAllocatorType::OrtDeviceAllocator,
                    OrtMemType::OrtMemTypeDefault,
                    &mut info,
                )
            },
            "cannot describe CPU memory",
        )?;
        // SAFETY: OrtAllocator::default only zeroes the optional entries.
        let mut table = unsafe { OrtAllocator::default() };
        table.Alloc = Some(alloc);
        table.Free = Some(give_back);
        table.Info = Some(memory_info);
        table.Reserve = Some(reserve);
        // Leaked: the environment keeps a pointer to it for the process's life. ONNX
        // Runtime calls it from any thread; what it changes is behind `CACHE`'s lock.
        let allocator = Box::into_raw(Box::new(CachingAllocator { table, info }));
        check(
            // SAFETY: `allocator` outlives the environment; its table is its first field
            // (repr(C)), so the pointer is also an `OrtAllocator` pointer.
            unsafe { (ort::api().RegisterAllocator)(env.ptr().cast_mut(), allocator.cast()) },
            "cannot register the caching allocator",
        )?;
        Ok(())
    });
    registered.clone()
}

/// Gives every cached block back to the system (the server has gone idle, or a
/// benchmark starts afresh).
pub fn release_cached() {
    let blocks = cache().drain();
    if !blocks.is_empty() {
        let bytes: usize = blocks.iter().map(|b| b.size).sum();
        tracing::debug!(blocks = blocks.len(), bytes, "block cache given back");
    }
    unmap(blocks);
}

/// A model run on a session of this allocator, in flight until dropped (the cache's
/// ceiling learns from the runs that were alone: `block_cache`).
pub struct RunInFlight(());

impl RunInFlight {
    pub fn start() -> Self {
        cache().run_started();
        RunInFlight(())
    }
}

impl Drop for RunInFlight {
    fn drop(&mut self) {
        cache().run_ended();
    }
}

/// The cache's counts so far.
pub fn stats() -> CacheStats {
    cache().stats()
}
