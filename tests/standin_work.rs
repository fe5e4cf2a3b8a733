//! The stand-in CUDA driver's device work (celer_standin_enqueue_work: how the stand-in
//! TensorRT runs an engine, in stream order over checked device memory), its primary
//! context reset as CUDA documents it, and GPUs of different compute capabilities. As in
//! standin_catches.rs, each planted misuse must be caught, naming what it was, and its
//! correct twin must pass.
//!
//! The work here is a Rust closure queued through the stand-in crate's wrapper; it writes
//! device memory through its address, as the stand-in TensorRT does (device memory is
//! this process's memory on the stand-in).

// `unsafe` here: calls the CUDA driver directly; each block says why it is sound.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use celer::cuda::driver::sys::{self, CUdevice_attribute};
use celer::cuda::driver::{code, CudaContext, CudaStream, DriverError};
use celer::cuda::kernels::COMPILE_OPTIONS;
use celer::cuda::nvrtc::{Nvrtc, Source};
use celer::cuda::Arch;
use celer_cuda_standin::{stray_work_calls, QueuedWork, StandIn, WorkRange, PLANTED_KERNELS};

/// One test at a time: they share device 0's primary context, and each ends with it
/// released (or reset), so that the next one starts on a fresh one.
fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The stand-in, loaded before any CUDA call of this process.
fn standin() -> &'static StandIn {
    static LOADED: OnceLock<&'static StandIn> = OnceLock::new();
    LOADED.get_or_init(|| {
        // SAFETY: cudarc's check only dlopens the driver library by name and closes it.
        let real = unsafe { cudarc::driver::sys::is_culib_present() };
        assert!(
            !real,
            "a real CUDA driver is installed, and cudarc's loader would load it: these tests are of the stand-in"
        );
        StandIn::load().expect("the stand-in driver loads")
    })
}

/// A CUresult as the stand-in's own C interface returns it.
fn as_c_int(result: u32) -> i32 {
    result as i32
}

fn driver_code(e: &DriverError) -> u32 {
    e.code()
        .unwrap_or_else(|| panic!("not the driver's answer: {e}"))
}

struct Gpu {
    standin: &'static StandIn,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
}

impl Gpu {
    fn new() -> Gpu {
        let standin = standin();
        let context = CudaContext::new(0).expect("the stand-in's GPU 0");
        let stream = context.new_stream().expect("a stream");
        standin.clear_last_error();
        Gpu {
            standin,
            stream,
            context,
        }
    }

    /// `bytes` of device memory, zeroed, ready in `stream`'s order.
    fn alloc(&self, bytes: usize) -> u64 {
        let mut address = 0;
        // SAFETY: a valid out-pointer and a live stream of the current context.
        unsafe { sys::cuMemAllocAsync(&mut address, bytes, self.stream.cu_stream()) }
            .result()
            .expect("device memory");
        // SAFETY: [address, +bytes) was just allocated on this stream.
        unsafe { sys::cuMemsetD8Async(address, 0, bytes, self.stream.cu_stream()) }
            .result()
            .expect("zeroed");
        address
    }

    /// Queues the free of `address` on `stream`.
    fn free_on(&self, address: u64, stream: &CudaStream) -> Result<(), DriverError> {
        // SAFETY: the driver checks the pointer; nothing of this process uses it after.
        unsafe { sys::cuMemFreeAsync(address, stream.cu_stream()) }.result()
    }

    /// `bytes` of device memory at `address`, once `self.stream` has reached this point.
    fn read(&self, address: u64, bytes: usize) -> Vec<u8> {
        self.stream.synchronize().expect("the stream runs");
        let mut host = vec![0u8; bytes];
        // SAFETY: `host` holds `bytes` bytes; the driver checks the device range.
        unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), address, bytes) }
            .result()
            .expect("a download");
        host
    }

    fn queue(
        &self,
        label: &str,
        ranges: &[WorkRange<'_>],
        run: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> QueuedWork {
        let stream = self.stream.cu_stream().cast::<c_void>();
        self.standin.enqueue_work(stream, label, ranges, run)
    }
}

/// Writes `value` over [address, +bytes) from queued work.
fn fill(address: u64, bytes: usize, value: u8) -> impl FnOnce() -> Result<(), String> + Send {
    move || {
        // SAFETY: the stand-in's device memory is memory of this process, and the driver
        // has checked, just before calling the work, that the range is live (the planted
        // misuses write a range declared read only, or into the alignment padding after
        // one: still mapped memory, which the driver inspects afterwards).
        unsafe { std::ptr::write_bytes(address as *mut u8, value, bytes) };
        Ok(())
    }
}

fn written<'a>(address: u64, bytes: usize, what: &'a str) -> WorkRange<'a> {
    WorkRange {
        address,
        bytes,
        writes: true,
        what,
    }
}

fn read_only<'a>(address: u64, bytes: usize, what: &'a str) -> WorkRange<'a> {
    WorkRange {
        address,
        bytes,
        writes: false,
        what,
    }
}

/// (flags, active) of device `device`'s primary context.
fn primary_state(device: i32) -> (u32, i32) {
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: valid out-pointers; the driver checks the device.
    unsafe { sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) }
        .result()
        .expect("the primary context's state");
    (flags, active)
}

#[test]
fn work_runs_when_its_stream_is_synchronised_not_when_queued() {
    let _one = serial();
    let gpu = Gpu::new();
    let buffer = gpu.alloc(256);
    let ran = Arc::new(AtomicBool::new(false));
    let (enqueued, run_before) = (
        gpu.standin.counter("work_enqueued"),
        gpu.standin.counter("work_run"),
    );

    let flag = ran.clone();
    let write = fill(buffer, 256, 0x5a);
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[written(buffer, 256, "output `mask`")],
        move || {
            flag.store(true, Ordering::SeqCst);
            write()
        },
    );
    assert_eq!(work.result(), 0, "{}", gpu.standin.last_error());
    // Queued, not run: the caller reading the output now would read what was there.
    assert!(!ran.load(Ordering::SeqCst), "the work ran at the call");
    assert_eq!((work.runs(), work.dones()), (0, 0));
    assert_eq!(gpu.standin.counter("work_enqueued"), enqueued + 1);
    assert_eq!(gpu.standin.counter("work_run"), run_before);

    gpu.stream.synchronize().expect("the work runs");
    assert!(ran.load(Ordering::SeqCst));
    assert_eq!((work.runs(), work.dones()), (1, 1));
    assert_eq!(gpu.standin.counter("work_run"), run_before + 1);
    assert!(gpu.read(buffer, 256).iter().all(|&b| b == 0x5a));
    assert_eq!(stray_work_calls(), 0);
}

#[test]
fn events_and_context_synchronisation_order_work_like_any_other_operation() {
    let _one = serial();
    let gpu = Gpu::new();
    let other = gpu.context.new_stream().expect("a second stream");
    let buffer = gpu.alloc(64);
    gpu.stream.synchronize().unwrap();
    let ran = Arc::new(AtomicBool::new(false));

    // Work on the first stream, an event after it, the second stream waiting for it:
    // synchronising the second stream alone runs the work.
    let flag = ran.clone();
    let work = gpu.queue("first", &[written(buffer, 64, "the buffer")], move || {
        flag.store(true, Ordering::SeqCst);
        Ok(())
    });
    assert_eq!(work.result(), 0, "{}", gpu.standin.last_error());
    let reached = gpu.stream.record_event(None).expect("an event");
    other.wait(&reached).expect("a wait for it");
    assert!(!ran.load(Ordering::SeqCst));
    other.synchronize().expect("the second stream");
    assert!(ran.load(Ordering::SeqCst), "the wait did not run the work");
    assert_eq!(work.dones(), 1);

    // cuEventSynchronize on an event recorded after the work.
    let second = gpu.queue("second", &[written(buffer, 64, "the buffer")], || Ok(()));
    let after = gpu.stream.record_event(None).expect("an event");
    assert_eq!(second.runs(), 0);
    after.synchronize().expect("the event");
    assert_eq!((second.runs(), second.dones()), (1, 1));

    // cuCtxSynchronize runs every stream's work.
    let third = gpu.queue("third", &[written(buffer, 64, "the buffer")], || Ok(()));
    assert_eq!(third.runs(), 0);
    gpu.context.synchronize().expect("the context");
    assert_eq!((third.runs(), third.dones()), (1, 1));
    assert_eq!(stray_work_calls(), 0);
}

#[test]
fn a_host_pointer_range_is_refused_when_queued() {
    let _one = serial();
    let gpu = Gpu::new();
    let host = vec![0u8; 256];
    let enqueued = gpu.standin.counter("work_enqueued");

    // Planted: a host buffer bound as an engine's input.
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[read_only(host.as_ptr() as u64, 256, "input `input.1`")],
        || Ok(()),
    );
    assert_eq!(work.result(), as_c_int(code::CUDA_ERROR_INVALID_VALUE));
    let why = gpu.standin.last_error();
    assert!(
        why.contains("TensorRT engine `u2netp`")
            && why.contains("input `input.1`")
            && why.contains("not device memory"),
        "{why}"
    );
    // Refused: nothing queued, `done` already called, the context still works.
    assert_eq!((work.runs(), work.dones()), (0, 1));
    assert_eq!(gpu.standin.counter("work_enqueued"), enqueued);
    gpu.stream.synchronize().expect("not sticky");

    // The twin: the same input in device memory; and an empty tensor's null address.
    let input = gpu.alloc(256);
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[
            read_only(input, 256, "input `input.1`"),
            read_only(0, 0, "input `empty`"),
        ],
        || Ok(()),
    );
    assert_eq!(work.result(), 0, "{}", gpu.standin.last_error());
    gpu.stream.synchronize().expect("the work runs");
    assert_eq!((work.runs(), work.dones()), (1, 1));
    assert_eq!(stray_work_calls(), 0);
}

#[test]
fn work_over_memory_freed_before_it_runs_is_an_illegal_address_and_sticky() {
    let _one = serial();
    let gpu = Gpu::new();
    let other = gpu.context.new_stream().expect("a second stream");

    // The twin: the work runs before its memory is freed, in stream order.
    let buffer = gpu.alloc(1024);
    let work = gpu.queue(
        "engine",
        &[written(buffer, 1024, "output `mask`")],
        fill(buffer, 1024, 1),
    );
    gpu.free_on(buffer, &gpu.stream)
        .expect("freed after the work");
    gpu.stream.synchronize().expect("work, then free");
    assert_eq!((work.runs(), work.dones()), (1, 1));

    // Planted, on one stream: a free queued before the work. Refused when queued (as a
    // kernel launch over it is), naming the range.
    let buffer = gpu.alloc(1024);
    gpu.free_on(buffer, &gpu.stream).expect("a queued free");
    let work = gpu.queue("engine", &[written(buffer, 1024, "output `mask`")], || {
        Ok(())
    });
    assert_eq!(work.result(), as_c_int(code::CUDA_ERROR_INVALID_VALUE));
    let why = gpu.standin.last_error();
    assert!(
        why.contains("engine") && why.contains("output `mask`") && why.contains("already queued"),
        "{why}"
    );
    assert_eq!((work.runs(), work.dones()), (0, 1));
    gpu.stream.synchronize().expect("not sticky");

    // Planted, across streams: the work is queued first, but the free, on another stream
    // without an event between them, runs first. The work must not run over it.
    let buffer = gpu.alloc(1024);
    gpu.stream.synchronize().unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[read_only(buffer, 1024, "input `input.1`")],
        move || {
            flag.store(true, Ordering::SeqCst);
            Ok(())
        },
    );
    assert_eq!(work.result(), 0, "{}", gpu.standin.last_error());
    // Refused when queued, by the cross-stream hazard check, naming both...
    let err = gpu
        .free_on(buffer, &other)
        .expect_err("a free racing the work");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_INVALID_VALUE);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("cross-stream hazard")
            && why.contains("cuMemFreeAsync")
            && why.contains("TensorRT engine `u2netp`")
            && why.contains("read"),
        "{why}"
    );
    // ... and, with that check off, caught when the work runs over the freed memory.
    let hazards = gpu.standin.set_hazards(false);
    let freed = gpu.free_on(buffer, &other);
    gpu.standin.set_hazards(hazards);
    freed.expect("a free on the other stream");
    other.synchronize().expect("the free runs");
    let err = gpu
        .stream
        .synchronize()
        .expect_err("the freed range is caught");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_ILLEGAL_ADDRESS);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("TensorRT engine `u2netp`")
            && why.contains("input `input.1`")
            && why.contains(&format!("{buffer:#x}"))
            && why.contains("freed by cuMemFreeAsync"),
        "{why}"
    );
    assert!(
        !ran.load(Ordering::SeqCst),
        "run was called over freed memory"
    );
    assert_eq!((work.runs(), work.dones()), (0, 1));
    // Sticky, as a kernel's illegal address: work queued now is refused, done at once.
    let after = gpu.queue("engine", &[], || Ok(()));
    assert_eq!(after.result(), as_c_int(code::CUDA_ERROR_ILLEGAL_ADDRESS));
    assert_eq!(after.dones(), 1);
    assert_eq!(stray_work_calls(), 0);
    // Dropped here: the last release destroys the context, error and all.
}

#[test]
fn a_failing_run_is_a_sticky_launch_failure_with_its_reason() {
    let _one = serial();
    {
        let gpu = Gpu::new();
        let buffer = gpu.alloc(64);
        // Planted: the engine fails; work queued behind it must not run.
        let failing = gpu.queue(
            "TensorRT engine `u2netp`",
            &[written(buffer, 64, "output `mask`")],
            || Err("ONNX Runtime: input `input.1` has 3 dimensions, the model wants 4".into()),
        );
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        let behind = gpu.queue(
            "behind",
            &[written(buffer, 64, "output `mask`")],
            move || {
                flag.store(true, Ordering::SeqCst);
                Ok(())
            },
        );
        assert_eq!((failing.result(), behind.result()), (0, 0));
        let err = gpu
            .stream
            .synchronize()
            .expect_err("the failure is reported");
        assert_eq!(driver_code(&err), code::CUDA_ERROR_LAUNCH_FAILED);
        let why = gpu.standin.last_error();
        assert!(
            why.contains(
                "TensorRT engine `u2netp`: ONNX Runtime: input `input.1` has 3 dimensions, the model wants 4"
            ),
            "{why}"
        );
        assert_eq!((failing.runs(), failing.dones()), (1, 1));
        assert!(!ran.load(Ordering::SeqCst), "work behind a failure ran");
        assert_eq!((behind.runs(), behind.dones()), (0, 1));
        // Sticky: every later call fails.
        let err = gpu.stream.synchronize().expect_err("sticky");
        assert_eq!(driver_code(&err), code::CUDA_ERROR_LAUNCH_FAILED);
        assert_eq!(stray_work_calls(), 0);
    }
    // The twin, on the fresh context the last release leaves: the same work succeeding.
    let gpu = Gpu::new();
    let buffer = gpu.alloc(64);
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[written(buffer, 64, "output `mask`")],
        fill(buffer, 64, 7),
    );
    gpu.stream.synchronize().expect("a healthy context");
    assert_eq!((work.runs(), work.dones()), (1, 1));
    assert!(gpu.read(buffer, 64).iter().all(|&b| b == 7));
}

#[test]
fn work_that_writes_a_range_declared_read_only_is_caught() {
    let _one = serial();
    let gpu = Gpu::new();
    let weights = gpu.alloc(4096);
    let output = gpu.alloc(4096);

    // The twin: the weights read, the output written.
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[
            read_only(weights, 4096, "the engine's weights"),
            written(output, 4096, "output `mask`"),
        ],
        fill(output, 4096, 3),
    );
    gpu.stream.synchronize().expect("a correct engine");
    assert_eq!(work.dones(), 1);

    // Planted: the engine writes into its weights.
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[
            read_only(weights, 4096, "the engine's weights"),
            written(output, 4096, "output `mask`"),
        ],
        fill(weights + 100, 1, 9),
    );
    let err = gpu.stream.synchronize().expect_err("the write is caught");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_LAUNCH_FAILED);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("TensorRT engine `u2netp`")
            && why.contains("the engine's weights")
            && why.contains("declared read only"),
        "{why}"
    );
    assert_eq!((work.runs(), work.dones()), (1, 1));
    assert_eq!(stray_work_calls(), 0);
}

#[test]
fn work_writing_past_the_end_of_its_output_is_an_illegal_address() {
    let _one = serial();
    let gpu = Gpu::new();
    // 1000 bytes: the allocation starts 256-byte aligned, so 24 bytes of padding follow it
    // before the guard page, where an overrun does not fault at once.
    let output = gpu.alloc(1000);

    // The twin: exactly the output.
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[written(output, 1000, "output `mask`")],
        fill(output, 1000, 1),
    );
    gpu.stream.synchronize().expect("a correct engine");
    assert_eq!(work.dones(), 1);

    // Planted: one byte more than the output holds.
    let work = gpu.queue(
        "TensorRT engine `u2netp`",
        &[written(output, 1000, "output `mask`")],
        fill(output, 1001, 1),
    );
    let err = gpu.stream.synchronize().expect_err("the overrun is caught");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_ILLEGAL_ADDRESS);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("TensorRT engine `u2netp`")
            && why.contains("output `mask`")
            && why.contains("0 bytes past the end of the 1000-byte allocation"),
        "{why}"
    );
    assert_eq!((work.runs(), work.dones()), (1, 1));
    assert_eq!(stray_work_calls(), 0);
}

#[test]
fn work_still_queued_when_its_context_is_reset_is_dropped_and_done_once() {
    let _one = serial();
    let gpu = Gpu::new();
    let buffer = gpu.alloc(64);

    // The twin: a stream destroyed with work queued runs it first, as on a GPU.
    let doomed = gpu.context.new_stream().expect("a stream");
    // The buffer is ready (allocated and zeroed on gpu.stream) before the other stream
    // uses it.
    gpu.stream.synchronize().unwrap();
    let work = gpu.standin.enqueue_work(
        doomed.cu_stream().cast(),
        "on a doomed stream",
        &[written(buffer, 64, "the buffer")],
        || Ok(()),
    );
    drop(doomed);
    assert_eq!((work.runs(), work.dones()), (1, 1));
    // cuStreamDestroy does not wait for its work on a GPU: the host does, before another
    // stream writes the buffer.
    gpu.context.synchronize().unwrap();

    // Reset with work queued: it never runs, and `done` frees its state.
    let work = gpu.queue(
        "queued at the reset",
        &[written(buffer, 64, "the buffer")],
        || Ok(()),
    );
    assert_eq!(work.result(), 0, "{}", gpu.standin.last_error());
    // SAFETY: device 0 exists; the reset destroys what the handles above refer to, which
    // is then only dropped (celer's driver layer logs the errors of its destroy calls).
    unsafe { sys::cuDevicePrimaryCtxReset_v2(0) }
        .result()
        .expect("reset");
    assert_eq!((work.runs(), work.dones()), (0, 1));
    assert_eq!(stray_work_calls(), 0);
    drop(gpu);
    assert_eq!(primary_state(0).1, 0, "released after the reset");
}

#[test]
fn reset_destroys_the_primary_context_but_keeps_its_retains() {
    let _one = serial();
    let standin = standin();
    // SAFETY: cuInit(0) before the raw retains below (CudaContext::new calls it in Gpu::new).
    unsafe { sys::cuInit(0) }.result().expect("cuInit");
    let retain = || {
        let mut context = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; device 0 exists.
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, 0) }
            .result()
            .expect("a retain");
        context
    };
    // SAFETY: device 0 exists; the driver counts the retains.
    let release = || unsafe { sys::cuDevicePrimaryCtxRelease_v2(0) }.result();
    // SAFETY: the driver refuses a dead handle instead of touching it.
    let make_current = |context| unsafe { sys::cuCtxSetCurrent(context) }.result();
    // SAFETY: no arguments; works in the current context.
    let synchronize = || unsafe { sys::cuCtxSynchronize() }.result();
    let created = standin.counter("contexts_created");

    // Two holders, as celer and the TensorRT runtime: one context, retained twice.
    let celer = retain();
    let tensorrt = retain();
    assert_eq!(celer, tensorrt);
    assert_eq!(standin.counter("contexts_created"), created + 1);
    make_current(celer).expect("current");
    let fails = standin.enqueue_work(
        std::ptr::null_mut(),
        "engine",
        &[],
        || Err("planted".into()),
    );
    assert_eq!(fails.result(), 0, "{}", standin.last_error());
    let err = synchronize().expect_err("sticky now");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_LAUNCH_FAILED);

    // celer lets go of its reference: the other holder keeps the context, error and all.
    release().expect("one release");
    assert_eq!(primary_state(0).1, 1);
    let err = synchronize().expect_err("still sticky");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_LAUNCH_FAILED);

    // The reset destroys it whoever holds it; its handle is dead.
    // SAFETY: device 0 exists.
    unsafe { sys::cuDevicePrimaryCtxReset_v2(0) }
        .result()
        .expect("reset");
    assert_eq!(primary_state(0).1, 0, "no context after the reset");
    let err = make_current(celer).expect_err("a dead handle");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_INVALID_CONTEXT);

    // A fresh retain: a new, healthy context (not at the dead one's address).
    let fresh = retain();
    assert_ne!(fresh, celer);
    assert_eq!(standin.counter("contexts_created"), created + 2);
    assert_eq!(primary_state(0).1, 1);
    make_current(fresh).expect("current");
    synchronize().expect("healthy");
    let runs = standin.enqueue_work(std::ptr::null_mut(), "engine", &[], || Ok(()));
    synchronize().expect("work runs");
    assert_eq!((runs.runs(), runs.dones()), (1, 1));

    // The reset did not release: the retain from before it counts down without failing,
    // and the fresh context lives on for its own holder.
    release().expect("the TensorRT runtime's release, after the reset");
    synchronize().expect("still alive: the fresh retain holds it");
    release().expect("the last release");
    assert_eq!(primary_state(0).1, 0);
    let err = make_current(fresh).expect_err("destroyed by the last release");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_INVALID_CONTEXT);
    // Exact counting: one release too many is refused.
    let err = release().expect_err("nothing retained");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_INVALID_CONTEXT);
    // SAFETY: clearing the current context is always allowed.
    unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) }
        .result()
        .unwrap();
    standin.clear_last_error();
    assert_eq!(stray_work_calls(), 0);
}

/// Set in the processes that each_device_has_its_own_compute_capability starts: what the
/// process is for ("list" or "typo").
const CHILD: &str = "CELER_STANDIN_WORK_CHILD";

#[test]
fn each_device_has_its_own_compute_capability() {
    let name = "each_device_has_its_own_compute_capability";
    match std::env::var(CHILD).as_deref() {
        Err(_) => {
            // Three GPUs of two models: sm_90, then two sm_86.
            celer_cuda_standin::run_test_in_child(
                name,
                &[
                    (CHILD, "list"),
                    ("CELER_CUDA_STANDIN_DEVICES", "3"),
                    ("CELER_CUDA_STANDIN_SM", "90,86"),
                ],
            );
            // Planted: a typo in the list. Refused, instead of quietly testing sm_90.
            celer_cuda_standin::run_test_in_child(
                name,
                &[(CHILD, "typo"), ("CELER_CUDA_STANDIN_SM", "90;86")],
            );
            return;
        }
        Ok("typo") => {
            let standin = standin();
            let err = CudaContext::new(0).expect_err("cuInit refuses the setting");
            assert_eq!(driver_code(&err), code::CUDA_ERROR_INVALID_VALUE);
            let why = standin.last_error();
            assert!(why.contains("CELER_CUDA_STANDIN_SM=90;86"), "{why}");
            return;
        }
        Ok(_) => {}
    }
    standin();
    let gpus: Vec<Arc<CudaContext>> = (0..3)
        .map(|i| CudaContext::new(i).expect("a stand-in GPU"))
        .collect();
    let sm = |gpu: &CudaContext| {
        let major = gpu
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .unwrap();
        let minor = gpu
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .unwrap();
        (major, minor)
    };
    let names: Vec<String> = gpus.iter().map(|g| g.name().unwrap()).collect();
    assert_eq!(sm(&gpus[0]), (9, 0));
    assert_eq!(sm(&gpus[1]), (8, 6));
    assert_eq!(
        sm(&gpus[2]),
        (8, 6),
        "devices past the list get its last entry"
    );
    assert!(names[0].contains("stand-in") && names[0].contains("sm_90"));
    assert!(names[1].contains("stand-in") && names[1].contains("sm_86"));
    assert_ne!(names[0], names[1], "two models, two names");
    assert_eq!(names[1], names[2]);

    // A CUBIN runs on its own major architecture, at its minor version or a later one:
    // each device checks against its own.
    let cubin = |arch: Arch| {
        let source = Source {
            name: "planted.cu",
            text: PLANTED_KERNELS,
            headers: &[],
        };
        Nvrtc::for_driver(celer::cuda::probe::driver_version().expect("the driver's version"))
            .expect("NVRTC (make python)")
            .compile_cubin(&source, arch, &COMPILE_OPTIONS)
            .expect("the planted kernels compile")
    };
    gpus[0]
        .load_module(&cubin(Arch::new(9, 0)))
        .expect("sm_90 on the sm_90 GPU");
    gpus[1]
        .load_module(&cubin(Arch::new(8, 0)))
        .expect("sm_80 on the sm_86 GPU");
    let err = gpus[1]
        .load_module(&cubin(Arch::new(9, 0)))
        .expect_err("sm_90 on the sm_86 GPU");
    assert_eq!(driver_code(&err), code::CUDA_ERROR_NO_BINARY_FOR_GPU);

    // Device work stays on its own device: memory of GPU 1 in work on GPU 0 is refused.
    let on_gpu1 = gpus[1].new_stream().unwrap();
    let mut address = 0;
    // SAFETY: a valid out-pointer and a live stream of GPU 1's context.
    unsafe { sys::cuMemAllocAsync(&mut address, 64, on_gpu1.cu_stream()) }
        .result()
        .unwrap();
    let on_gpu0 = gpus[0].new_stream().unwrap();
    let standin = standin();
    let work = standin.enqueue_work(
        on_gpu0.cu_stream().cast(),
        "engine",
        &[read_only(address, 64, "input `input.1`")],
        || Ok(()),
    );
    assert_eq!(work.result(), as_c_int(code::CUDA_ERROR_INVALID_VALUE));
    let why = standin.last_error();
    assert!(
        why.contains("input `input.1`") && why.contains("another context"),
        "{why}"
    );
    assert_eq!(work.dones(), 1);
}
