//! celer's stand-in CUDA driver, for the tests: a `libcuda.so.1` (built by build.rs from
//! driver/ and the kernels' `.cu` sources) that cudarc's loader (celer's driver layer
//! resolves through it) finds as it finds the real driver, and that runs celer's kernels
//! on the CPU with a GPU's rules (driver/driver.cpp says which). This crate only says where the library is and reaches its test controls.
//!
//! Two ways in:
//! - another process: start it with [`library_dir`] on `LD_LIBRARY_PATH`; cudarc's search
//!   by name finds the stand-in first (the directory has `libcuda.so` and `libcuda.so.1`);
//! - this process: [`StandIn::load`] before the first CUDA call; cudarc's later
//!   `dlopen("libcuda.so.1")` then finds it already loaded, by its soname.
//!
//! The library is built once per CUDA version ([`versions`]: 11.8, below the floor celer
//! supports, then 12.2, the floor, to 13.0); `CELER_TEST_CUDA_DRIVER` picks the one a test
//! run loads ([`version`]), and an older one lacks the newer entry points, as the real
//! driver of that version does.
//!
//! [`StandIn::enqueue_work`] queues device work as the stand-in TensorRT does
//! (driver/celer_standin_work.h), with Rust closures, for the stand-in's own tests.
//!
//! The stand-in's modes (driver/driver.cpp's header: execution order, `__shared__` and
//! device memory poison, cross-stream hazards, launch limits, chosen return codes) are set
//! by environment variables at `cuInit`; in this process [`StandIn::set_order`],
//! [`StandIn::set_shared_poison`], [`StandIn::set_hazards`], [`StandIn::mark_writes`],
//! [`StandIn::poison_written`], [`StandIn::poison_live`] and [`StandIn::inject_return`]
//! change or use them, and [`StandIn::counters`] says what the code did on the device.
//!
//! Pinned host memory is of two kinds, treated alike by copies (asynchronous DMA, checked
//! when the stream gets there): `cuMemHostAlloc`'s, and the caller's own memory registered
//! with `cuMemHostRegister_v2` (until `cuMemHostUnregister`, or until the context that
//! registered it is destroyed: a registration is its context's, whatever its flags). A
//! copy from or to any other host memory is pageable ([`Counters::pageable_htod_copies`],
//! [`Counters::pageable_dtoh_copies`]).

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The folder of the built libraries, one per CUDA version: `<version>/libcuda.so.1`.
const DRIVERS: &str = env!("CELER_CUDA_STANDIN_DRIVERS");

/// The CUDA versions the stand-in can be, oldest first (build.rs: 11.8, 12.2, 12.4, 12.8,
/// 13.0).
/// Each reports its version and exports only the entry points that version has.
pub fn versions() -> Vec<&'static str> {
    env!("CELER_CUDA_STANDIN_VERSIONS").split(',').collect()
}

/// The version used unless `CELER_TEST_CUDA_DRIVER` names another.
pub const DEFAULT_VERSION: &str = "13.0";

/// Names the version of the stand-in that the tests load, e.g. `12.2`.
pub const VERSION_ENV: &str = "CELER_TEST_CUDA_DRIVER";

/// Names `CELER_CUDA_STANDIN_COUNTERS_AT_EXIT`: where the stand-in writes its counters when
/// the process exits (driver/driver.cpp's header), for a test of a server in another
/// process; [`counters_written_at_exit`] reads them.
pub const COUNTERS_AT_EXIT_ENV: &str = "CELER_CUDA_STANDIN_COUNTERS_AT_EXIT";

/// The counters a process wrote at its exit to `path` (see [`COUNTERS_AT_EXIT_ENV`]): each
/// by its name, a device's as `name[device]` (`calls_in_lost_context[0]`). `Err` when the
/// file is missing (the process did not exit through `exit`: it was killed, or aborted)
/// or a line is not `name value`.
pub fn counters_written_at_exit(path: &Path) -> Result<BTreeMap<String, u64>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "{}: {e} (the process exits through exit() to write it)",
            path.display()
        )
    })?;
    text.lines()
        .map(|line| {
            let (name, value) = line
                .split_once(' ')
                .ok_or_else(|| format!("`{line}` is not `name value`"))?;
            let value = value.parse::<u64>().map_err(|e| format!("`{line}`: {e}"))?;
            Ok((name.to_string(), value))
        })
        .collect()
}

/// The test kernels with planted bugs (tests/standin_catches.rs), as NVRTC compiles them.
pub const PLANTED_KERNELS: &str = include_str!("../kernels/planted.cu");

/// The stand-in of CUDA `version` (one of [`versions`]).
pub fn library_of(version: &str) -> Result<PathBuf, String> {
    if !versions().contains(&version) {
        return Err(format!(
            "the stand-in CUDA driver has no version {version:?}; it is built as {}",
            versions().join(", ")
        ));
    }
    Ok(Path::new(DRIVERS).join(version).join("libcuda.so.1"))
}

/// The version this process's tests use: `CELER_TEST_CUDA_DRIVER`, else 13.0. Panics on
/// a version the stand-in is not built as: a test run that asked for one must not quietly
/// run on another.
pub fn version() -> &'static str {
    static VERSION: OnceLock<&'static str> = OnceLock::new();
    VERSION.get_or_init(|| {
        let wanted = std::env::var(VERSION_ENV).unwrap_or_default();
        if wanted.is_empty() {
            return DEFAULT_VERSION;
        }
        versions()
            .into_iter()
            .find(|v| *v == wanted)
            .unwrap_or_else(|| {
                panic!(
                    "{VERSION_ENV}={wanted}: the stand-in CUDA driver is built as {}",
                    versions().join(", ")
                )
            })
    })
}

/// The library of [`version`].
pub fn library() -> PathBuf {
    library_of(version()).expect("version() is one of versions()")
}

/// The directory to put on `LD_LIBRARY_PATH` of a process that should use the stand-in
/// (of [`version`]).
pub fn library_dir() -> PathBuf {
    Path::new(DRIVERS).join(version())
}

/// The stand-in that the dynamic loader finds by name as cudarc looks for the driver
/// (`libcuda.so`, then `libcuda.so.1`: `LD_LIBRARY_PATH`, then the system's), as in a
/// packed GPU check run here with a stand-in's [`library_dir`] on `LD_LIBRARY_PATH`
/// (scripts/gpu-check-run `--standin`); `None` when it finds a real driver, or none. A
/// stand-in is told from a real driver by its own controls, which no real driver exports;
/// its file is read from this process's memory map while it is loaded.
pub fn found_by_name() -> Option<PathBuf> {
    ["libcuda.so", "libcuda.so.1"].iter().find_map(|name| {
        // SAFETY: opens the driver library the loader finds, as cudarc's own presence
        // check does (its initialisers only set up its own state), looks one symbol up
        // without calling it, and closes the library.
        let library = unsafe { libloading::Library::new(*name) }.ok()?;
        // SAFETY: only the symbol's presence is checked; it is never called.
        unsafe {
            library.get::<unsafe extern "C" fn() -> *const c_char>(b"celer_standin_last_error\0")
        }
        .ok()?;
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let found = maps
            .lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .find(|path| {
                Path::new(path)
                    .file_name()
                    .is_some_and(|f| f.to_string_lossy().starts_with("libcuda.so"))
            })
            .map(PathBuf::from);
        drop(library);
        found
    })
}

/// A fault to arm for a coming launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `cuLaunchKernel` returns CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES; the context stays usable.
    LaunchFails,
    /// The launch faults when it runs: CUDA_ERROR_ILLEGAL_ADDRESS, sticky, as a kernel's
    /// out-of-bounds access on a GPU.
    StickyError,
    /// The launch never ends when it runs, as a kernel on a GPU without a watchdog: the
    /// thread that runs its stream (a synchronisation) blocks until
    /// [`StandIn::release_hangs`] or the process's exit.
    Hang,
}

/// A range of device memory that queued work reads or writes.
#[derive(Debug, Clone, Copy)]
pub struct WorkRange<'a> {
    /// A device pointer (`CUdeviceptr`).
    pub address: u64,
    pub bytes: usize,
    /// False: the work only reads it (the stand-in checks that it did not change).
    pub writes: bool,
    /// Names the range in the stand-in's messages, e.g. "input `input.1`".
    pub what: &'a str,
}

/// `celer_standin_range` of driver/celer_standin_work.h.
#[repr(C)]
struct RawRange {
    address: u64,
    bytes: usize,
    writes: c_int,
    what: *const c_char,
}

type RunCallback = unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> c_int;
type DoneCallback = unsafe extern "C" fn(*mut c_void);
type EnqueueWork = unsafe extern "C" fn(
    *mut c_void,
    *const c_char,
    *const RawRange,
    usize,
    Option<RunCallback>,
    Option<DoneCallback>,
    *mut c_void,
) -> c_int;

type WorkFn = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// How often the driver called back one piece of queued work.
#[derive(Default)]
struct WorkCalls {
    runs: AtomicUsize,
    dones: AtomicUsize,
}

/// Work queued with [`StandIn::enqueue_work`]: what the driver answered, and what it has
/// called since.
#[derive(Clone)]
pub struct QueuedWork {
    result: c_int,
    calls: Arc<WorkCalls>,
}

impl QueuedWork {
    /// The CUresult of the enqueue: 0 (CUDA_SUCCESS) when the work was queued.
    pub fn result(&self) -> c_int {
        self.result
    }

    /// How many times the driver called `run` (at most once, at the stream's sync).
    pub fn runs(&self) -> usize {
        self.calls.runs.load(Ordering::SeqCst)
    }

    /// How many times the driver called `done` (exactly once, eventually, on every path).
    pub fn dones(&self) -> usize {
        self.calls.dones.load(Ordering::SeqCst)
    }
}

/// Queued work by token. The `user` pointer the driver hands back is this token, never
/// dereferenced: a `done` called twice, or a `run` after `done`, finds no entry (and is
/// counted in [`stray_work_calls`]) instead of freed memory.
struct PendingWork {
    run: Option<WorkFn>,
    calls: Arc<WorkCalls>,
}

static PENDING_WORK: Mutex<BTreeMap<usize, PendingWork>> = Mutex::new(BTreeMap::new());
static NEXT_WORK_TOKEN: AtomicUsize = AtomicUsize::new(1);
static STRAY_WORK_CALLS: AtomicUsize = AtomicUsize::new(0);

fn pending_work() -> std::sync::MutexGuard<'static, BTreeMap<usize, PendingWork>> {
    PENDING_WORK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Calls of `run` or `done` for work whose `done` had already been called: 0 unless the
/// driver broke "done exactly once".
pub fn stray_work_calls() -> usize {
    STRAY_WORK_CALLS.load(Ordering::SeqCst)
}

/// Copies `text` into the driver's `why` buffer of `capacity` bytes, NUL-terminated.
///
/// # Safety
/// `why` is null or writable for `capacity` bytes.
unsafe fn write_reason(why: *mut c_char, capacity: usize, text: &str) {
    if why.is_null() || capacity == 0 {
        return;
    }
    let n = text.len().min(capacity - 1);
    // SAFETY: n + 1 <= capacity bytes of a buffer the caller vouches for; the source is
    // `text`'s own bytes, which cannot overlap the driver's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), why, n);
        *why.add(n) = 0;
    }
}

/// `run` of celer_standin_work.h: the token's closure, on the synchronising thread.
unsafe extern "C" fn run_work(user: *mut c_void, why: *mut c_char, why_len: usize) -> c_int {
    let token = user.addr();
    let job = pending_work()
        .get_mut(&token)
        .map(|p| (p.run.take(), p.calls.clone()));
    let outcome = match job {
        Some((Some(run), calls)) => {
            calls.runs.fetch_add(1, Ordering::SeqCst);
            catch_unwind(AssertUnwindSafe(run))
                .unwrap_or_else(|_| Err("the work's closure panicked".to_string()))
        }
        Some((None, calls)) => {
            calls.runs.fetch_add(1, Ordering::SeqCst);
            Err("run was called twice".to_string())
        }
        None => {
            STRAY_WORK_CALLS.fetch_add(1, Ordering::SeqCst);
            Err("run was called after done".to_string())
        }
    };
    match outcome {
        Ok(()) => 0,
        Err(reason) => {
            // SAFETY: the driver passes a buffer of why_len bytes (celer_standin_work.h).
            unsafe { write_reason(why, why_len, &reason) };
            1
        }
    }
}

/// `done` of celer_standin_work.h: forgets the token, dropping its closure.
unsafe extern "C" fn done_work(user: *mut c_void) {
    let token = user.addr();
    let pending = pending_work().remove(&token);
    match pending {
        Some(p) => {
            p.calls.dones.fetch_add(1, Ordering::SeqCst);
            // The closure (and what it captured) drops here, outside the lock; a panic in
            // a captured value's Drop must not unwind into the driver.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
        }
        None => {
            STRAY_WORK_CALLS.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The stand-in, loaded into this process.
pub struct StandIn {
    last_error: unsafe extern "C" fn() -> *const c_char,
    clear_last_error: unsafe extern "C" fn(),
    last_note: unsafe extern "C" fn() -> *const c_char,
    inject: unsafe extern "C" fn(c_int, u64),
    inject_return: unsafe extern "C" fn(*const c_char, i64, u64) -> c_int,
    counter: unsafe extern "C" fn(*const c_char) -> u64,
    set_order: unsafe extern "C" fn(*const c_char) -> c_int,
    order: unsafe extern "C" fn() -> *const c_char,
    set_shared_poison: unsafe extern "C" fn(c_int) -> c_int,
    set_hazards: unsafe extern "C" fn(c_int) -> c_int,
    poison_live: unsafe extern "C" fn(u8) -> u64,
    mark_writes: unsafe extern "C" fn(),
    poison_written: unsafe extern "C" fn(u8) -> u64,
    enqueue_work: EnqueueWork,
    device_counter: unsafe extern "C" fn(*const c_char, c_int) -> u64,
    release_hangs: unsafe extern "C" fn() -> u64,
    _library: libloading::Library,
}

impl StandIn {
    /// Loads the stand-in (once per process). Call before anything else loads a CUDA
    /// driver: cudarc keeps the first one it finds for the life of the process.
    pub fn load() -> Result<&'static StandIn, String> {
        static LOADED: OnceLock<Result<StandIn, String>> = OnceLock::new();
        LOADED
            .get_or_init(|| {
                // SAFETY: loading the stand-in runs no initialiser beyond its kernels'
                // registration (static tables); the library stays loaded for the process.
                let path = library();
                let library = unsafe { libloading::Library::new(&path) }.map_err(|e| {
                    format!("cannot load the stand-in driver {}: {e}", path.display())
                })?;
                // SAFETY: each symbol is one of the stand-in's controls, declared in
                // driver/driver.cpp with exactly these C signatures.
                unsafe {
                    Ok(StandIn {
                        last_error: *library
                            .get(b"celer_standin_last_error\0")
                            .map_err(|e| e.to_string())?,
                        clear_last_error: *library
                            .get(b"celer_standin_clear_last_error\0")
                            .map_err(|e| e.to_string())?,
                        last_note: *library
                            .get(b"celer_standin_last_note\0")
                            .map_err(|e| e.to_string())?,
                        inject: *library
                            .get(b"celer_standin_inject\0")
                            .map_err(|e| e.to_string())?,
                        inject_return: *library
                            .get(b"celer_standin_inject_return\0")
                            .map_err(|e| e.to_string())?,
                        counter: *library
                            .get(b"celer_standin_counter\0")
                            .map_err(|e| e.to_string())?,
                        set_order: *library
                            .get(b"celer_standin_set_order\0")
                            .map_err(|e| e.to_string())?,
                        order: *library
                            .get(b"celer_standin_order\0")
                            .map_err(|e| e.to_string())?,
                        set_shared_poison: *library
                            .get(b"celer_standin_set_shared_poison\0")
                            .map_err(|e| e.to_string())?,
                        set_hazards: *library
                            .get(b"celer_standin_set_hazards\0")
                            .map_err(|e| e.to_string())?,
                        poison_live: *library
                            .get(b"celer_standin_poison_live\0")
                            .map_err(|e| e.to_string())?,
                        mark_writes: *library
                            .get(b"celer_standin_mark_writes\0")
                            .map_err(|e| e.to_string())?,
                        poison_written: *library
                            .get(b"celer_standin_poison_written\0")
                            .map_err(|e| e.to_string())?,
                        enqueue_work: *library
                            .get(b"celer_standin_enqueue_work\0")
                            .map_err(|e| e.to_string())?,
                        device_counter: *library
                            .get(b"celer_standin_device_counter\0")
                            .map_err(|e| e.to_string())?,
                        release_hangs: *library
                            .get(b"celer_standin_release_hangs\0")
                            .map_err(|e| e.to_string())?,
                        _library: library,
                    })
                }
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The details of the last error the stand-in reported ("" when none): which call,
    /// which kernel and parameter, which address, which lane.
    pub fn last_error(&self) -> String {
        // SAFETY: returns a NUL-terminated string owned by the calling thread, valid
        // until its next call on this thread; copied at once.
        unsafe { CStr::from_ptr((self.last_error)()) }
            .to_string_lossy()
            .into_owned()
    }

    /// The last note of a stand-in rule that changes no call's result ("registration ended
    /// with its context": a copy made pageable), empty when none was made.
    pub fn last_note(&self) -> String {
        // SAFETY: returns a NUL-terminated string owned by the calling thread, valid
        // until its next call on this thread; copied at once.
        unsafe { CStr::from_ptr((self.last_note)()) }
            .to_string_lossy()
            .into_owned()
    }

    pub fn clear_last_error(&self) {
        // SAFETY: no arguments; resets a string under the stand-in's lock.
        unsafe { (self.clear_last_error)() }
    }

    /// Arms `fault` for the `nth` launch from now (1: the next one).
    pub fn inject(&self, fault: Fault, nth: u64) {
        let kind = match fault {
            Fault::LaunchFails => 0,
            Fault::StickyError => 1,
            Fault::Hang => 2,
        };
        // SAFETY: plain values; the stand-in stores them in atomics.
        unsafe { (self.inject)(kind, nth) }
    }

    /// Makes the `nth` call of entry point `entry` from now (1: the next) answer `code`
    /// instead of doing anything, as `CELER_CUDA_STANDIN_RETURN=entry:code@nth` does from
    /// `cuInit` (`nth` 0 disarms `entry`). A code meaning a lost context (cuda.h's sticky
    /// ones, `CUDA_ERROR_CONTAINED` among them) or one the stand-in does not know (1000,
    /// say) makes the context's error sticky: every later call in it answers the same.
    /// `Err` (nothing armed) for an entry point this version does not export, 0, or a code
    /// a later CUDA introduced (226 before 12.8): such a driver never returns it.
    pub fn inject_return(&self, entry: &str, code: u32, nth: u64) -> Result<(), String> {
        let entry = CString::new(entry).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated name that outlives the call, and plain values.
        match unsafe { (self.inject_return)(entry.as_ptr(), i64::from(code), nth) } {
            0 => Ok(()),
            _ => Err(self.last_error()),
        }
    }

    /// Queues `run` on `stream` (a `CUstream` of the context current on this thread, or
    /// null for its null stream) as the stand-in TensorRT queues an engine's execution:
    /// it runs when the stream is synchronised, on the synchronising thread, after the
    /// driver has checked `ranges` (see driver/celer_standin_work.h). An `Err` from `run`
    /// makes the context's error sticky with the reason. The closure is dropped when the
    /// driver calls `done`; the returned [`QueuedWork`] says what the driver did.
    ///
    /// Safe to call with any `stream` and any addresses: the driver looks handles up
    /// among its live ones and checks every range before anything touches it.
    #[allow(
        clippy::not_unsafe_ptr_arg_deref,
        reason = "`stream` is a handle the driver looks up by value, never dereferenced unless live"
    )]
    pub fn enqueue_work(
        &self,
        stream: *mut c_void,
        label: &str,
        ranges: &[WorkRange<'_>],
        run: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> QueuedWork {
        let label = CString::new(label).expect("labels have no NUL");
        let whats: Vec<CString> = ranges
            .iter()
            .map(|r| CString::new(r.what).expect("range names have no NUL"))
            .collect();
        let raw: Vec<RawRange> = ranges
            .iter()
            .zip(&whats)
            .map(|(r, what)| RawRange {
                address: r.address,
                bytes: r.bytes,
                writes: c_int::from(r.writes),
                what: what.as_ptr(),
            })
            .collect();
        let calls = Arc::new(WorkCalls::default());
        let token = NEXT_WORK_TOKEN.fetch_add(1, Ordering::SeqCst);
        pending_work().insert(
            token,
            PendingWork {
                run: Some(Box::new(run)),
                calls: calls.clone(),
            },
        );
        // SAFETY: the label and the ranges (and their names) outlive the call, and the
        // driver copies what it keeps; run_work and done_work have the callback types of
        // celer_standin_work.h; `user` is a token that they look up, never a pointer.
        // The driver validates `stream` before use.
        let result = unsafe {
            (self.enqueue_work)(
                stream,
                label.as_ptr(),
                raw.as_ptr(),
                raw.len(),
                Some(run_work),
                Some(done_work),
                std::ptr::without_provenance_mut(token),
            )
        };
        QueuedWork { result, calls }
    }

    /// A counter of the stand-in by name (the fields of [`Counters`], and `device_bytes`:
    /// device memory in use now); `u64::MAX` for a name it does not know.
    pub fn counter(&self, name: &str) -> u64 {
        let name = CString::new(name).expect("counter names have no NUL");
        // SAFETY: a NUL-terminated name that outlives the call.
        unsafe { (self.counter)(name.as_ptr()) }
    }

    /// The order blocks run in and lanes start in, from the next launch that runs on:
    /// `forward`, `reverse` or `random:<seed>`, as `CELER_CUDA_STANDIN_ORDER` takes it
    /// (which sets it at `cuInit`; set it here after the first CUDA call). `Err` (and the
    /// order unchanged) for anything else.
    pub fn set_order(&self, order: &str) -> Result<(), String> {
        let text = CString::new(order).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated string that outlives the call.
        match unsafe { (self.set_order)(text.as_ptr()) } {
            0 => Ok(()),
            _ => Err(self.last_error()),
        }
    }

    /// The order now (`forward`, `reverse`, `random:<seed>`).
    pub fn order(&self) -> String {
        // SAFETY: a NUL-terminated string owned by the calling thread, copied at once.
        unsafe { CStr::from_ptr((self.order)()) }
            .to_string_lossy()
            .into_owned()
    }

    /// Turns the poisoning of `__shared__` variables at each block's start on or off
    /// (`CELER_CUDA_STANDIN_POISON_SHARED`); returns whether it was on.
    pub fn set_shared_poison(&self, on: bool) -> bool {
        // SAFETY: a plain value, stored in an atomic.
        unsafe { (self.set_shared_poison)(c_int::from(on)) != 0 }
    }

    /// Turns the cross-stream hazard check on or off (`CELER_CUDA_STANDIN_HAZARDS`);
    /// returns whether it was on. Turning it off forgets the accesses recorded.
    pub fn set_hazards(&self, on: bool) -> bool {
        // SAFETY: a plain value; the driver takes its own lock.
        unsafe { (self.set_hazards)(c_int::from(on)) != 0 }
    }

    /// Runs every stream's queued work, then fills every live device allocation with
    /// `byte`; returns how many allocations it filled.
    pub fn poison_live(&self, byte: u8) -> u64 {
        // SAFETY: a plain value; the driver takes its own locks.
        unsafe { (self.poison_live)(byte) }
    }

    /// Starts tracking which device allocations are written (a copy or memset into them, a
    /// launch with a pointer to non-const data into them, device work with a written range
    /// in them), forgetting what was tracked before.
    pub fn mark_writes(&self) {
        // SAFETY: no arguments; the driver takes its own locks.
        unsafe { (self.mark_writes)() }
    }

    /// Runs every stream's queued work, then fills with `byte` every live allocation
    /// written since [`StandIn::mark_writes`] (or the last call of this), and tracks anew
    /// from here; returns how many allocations it filled.
    pub fn poison_written(&self, byte: u8) -> u64 {
        // SAFETY: a plain value; the driver takes its own locks.
        unsafe { (self.poison_written)(byte) }
    }

    /// A counter of GPU `device` by name (`u64::MAX` for a name or a device it does not
    /// know): `calls_in_lost_context`, the calls made in a context of the device after its
    /// error became sticky (driver/driver.cpp's header, "Counted after a loss", says which
    /// calls count), and `lost_contexts`, the times a context of the device was lost (a
    /// sticky error, or a reset).
    pub fn device_counter(&self, name: &str, device: u32) -> u64 {
        let name = CString::new(name).expect("counter names have no NUL");
        let Ok(device) = c_int::try_from(device) else {
            return u64::MAX;
        };
        // SAFETY: a NUL-terminated name that outlives the call, and a plain value.
        unsafe { (self.device_counter)(name.as_ptr(), device) }
    }

    /// Lets every launch that hangs (`CELER_CUDA_STANDIN_HANG_LAUNCH`, the fault file's
    /// `hang`) go on; returns how many were hanging.
    pub fn release_hangs(&self) -> u64 {
        // SAFETY: no arguments; the driver takes its own locks.
        unsafe { (self.release_hangs)() }
    }

    /// Every counter now. Take one before and one after the code under test, and
    /// `after - before` (or [`Counters::delta`]) is what that code did. Each field is read
    /// on its own: take the two while no other thread of the process uses CUDA.
    pub fn counters(&self) -> Counters {
        let read = |name: &str| {
            let v = self.counter(name);
            assert_ne!(v, u64::MAX, "the stand-in driver has no counter {name:?}");
            v
        };
        Counters::read(read)
    }
}

macro_rules! counters {
    ($($(#[$doc:meta])* $field:ident,)*) => {
        /// The stand-in's counters ([`StandIn::counters`]): calls made since the library was
        /// loaded, in every context (driver/driver.cpp, `celer_standin_counter`).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct Counters {
            $($(#[$doc])* pub $field: u64,)*
        }

        impl Counters {
            /// The names `celer_standin_counter` knows them by (the field names).
            pub const NAMES: &'static [&'static str] = &[$(stringify!($field),)*];

            fn read(mut read: impl FnMut(&str) -> u64) -> Counters {
                Counters { $($field: read(stringify!($field)),)* }
            }

            /// What happened since `earlier` (each field `self - earlier`, saturating at 0).
            pub fn delta(&self, earlier: &Counters) -> Counters {
                Counters { $($field: self.$field.saturating_sub(earlier.$field),)* }
            }
        }
    };
}

counters! {
    /// `cuLaunchKernel` calls that queued a launch.
    launches_enqueued,
    /// Launches that ran (their stream got to them).
    launches_run,
    /// `cuMemcpyHtoD` and `cuMemcpyHtoDAsync` calls.
    htod_copies,
    htod_bytes,
    /// `cuMemcpyDtoH` and `cuMemcpyDtoHAsync` calls.
    dtoh_copies,
    dtoh_bytes,
    /// `cuMemcpyDtoDAsync` calls.
    dtod_copies,
    dtod_bytes,
    /// `cuMemsetD8` and `cuMemsetD8Async` calls (`alloc_zeros`, `memset_zeros`).
    memsets,
    memset_bytes,
    /// Contexts made (a primary context retained after its last release or a reset).
    contexts_created,
    /// `cuStreamSynchronize` calls.
    stream_syncs,
    /// `cuEventSynchronize` calls.
    event_syncs,
    /// `cuCtxSynchronize` calls.
    ctx_syncs,
    /// Every call at which the host waited for the device: `stream_syncs + event_syncs +
    /// ctx_syncs`, plus each copy or memset that returns only once its stream ran it
    /// (`cuMemcpyHtoD`, `cuMemcpyDtoH`, `cuMemsetD8`, and `cuMemcpyDtoHAsync` into pageable
    /// memory, which CUDA completes before returning). Polls (`cuStreamQuery`,
    /// `cuEventQuery`) are not waits.
    host_syncs,
    /// `cuMemAlloc` and `cuMemAllocAsync` calls that allocated.
    device_allocs,
    /// `cuMemFree` and `cuMemFreeAsync` calls accepted (not memory freed with its context).
    device_frees,
    /// `cuMemHostAlloc` calls that allocated, and their bytes.
    pinned_allocs,
    pinned_alloc_bytes,
    /// `cuMemFreeHost` calls accepted.
    pinned_frees,
    /// `cuMemHostRegister_v2` calls that registered (page-locked) host memory, and their
    /// bytes.
    host_registers,
    host_register_bytes,
    /// `cuMemHostUnregister` calls accepted (not registrations ended with their context).
    host_unregisters,
    /// `cuMemcpyHtoD` and `cuMemcpyHtoDAsync` calls of more than 0 bytes whose source is
    /// not page-locked (neither `cuMemHostAlloc` memory nor registered): the copies a real
    /// driver stages through a page-locked buffer of its own, a host copy of the data,
    /// synchronous or not.
    pageable_htod_copies,
    /// `cuMemcpyDtoH` and `cuMemcpyDtoHAsync` calls of more than 0 bytes whose destination
    /// is not page-locked (as `pageable_htod_copies`).
    pageable_dtoh_copies,
    /// Of the pageable copies, those from or to memory whose registration ended with the
    /// context that made it (rule "registration ended with its context": a reset of GPU 0's
    /// primary context makes GPU 1's copies from memory registered there pageable).
    pageable_after_context_end,
    /// Context errors that became sticky.
    sticky_errors,
    /// Device work queued (`celer_standin_enqueue_work`), and run.
    work_enqueued,
    work_run,
}

impl std::ops::Sub for Counters {
    type Output = Counters;

    /// [`Counters::delta`].
    fn sub(self, earlier: Counters) -> Counters {
        self.delta(&earlier)
    }
}

/// Runs `test` of the calling test binary alone in a process of its own, with `env` added,
/// and fails unless it passed: the stand-in reads its settings once per process, at
/// cuInit, so a test of a setting runs where nothing has initialised it yet.
pub fn run_test_in_child(test: &str, env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .output()
        .expect("the child process starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "in the child process: {text}"
    );
}
