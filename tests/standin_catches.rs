//! The stand-in CUDA driver has teeth. Each test plants one bug of a kind that a GPU
//! shows (in a test kernel of tests/cuda_standin/kernels/planted.cu, or in the test's own
//! launch; never in celer) and checks that the stand-in catches it and says where; each
//! also runs the correct twin, which must pass, so that a stand-in that refused
//! everything would fail here too.
//!
//! These test the stand-in itself, so they run on it even where a GPU exists (a real
//! GPU shows these bugs as wrong answers or nothing at all, which is the point).

// `unsafe` here: plants misuse of the CUDA driver and kernels; each block says why it is sound.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use celer::cuda::driver::sys::{self, CUevent_flags};
use celer::cuda::driver::{
    code as cu, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, Device, DriverError,
    LaunchConfig, OwnContext, PushKernelArg,
};
use celer::cuda::kernels::COMPILE_OPTIONS;
use celer::cuda::nvrtc::{Nvrtc, Source};
use celer::cuda::Arch;
use celer_cuda_standin::{Fault, StandIn, PLANTED_KERNELS};

/// One test at a time: a sticky error poisons the shared primary context, and each test
/// ends by releasing it, so the next one starts on a fresh context.
fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The stand-in, loaded before any CUDA call of this process.
fn standin() -> &'static StandIn {
    static LOADED: std::sync::OnceLock<&'static StandIn> = std::sync::OnceLock::new();
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

struct Gpu {
    standin: &'static StandIn,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
    module: Arc<CudaModule>,
}

impl Gpu {
    fn new() -> Gpu {
        let standin = standin();
        let context = CudaContext::new(0).expect("the stand-in's GPU 0");
        let cubin =
            Nvrtc::for_driver(celer::cuda::probe::driver_version().expect("the driver's version"))
                .expect("NVRTC (make python)")
                .compile_cubin(
                    &Source {
                        name: "planted.cu",
                        text: PLANTED_KERNELS,
                        headers: &[],
                    },
                    Arch::new(9, 0),
                    &COMPILE_OPTIONS,
                )
                .expect("the planted kernels compile");
        let module = context
            .load_module(&cubin)
            .expect("the stand-in loads NVRTC's CUBIN");
        let stream = context.new_stream().expect("a stream");
        standin.clear_last_error();
        Gpu {
            standin,
            stream,
            context,
            module,
        }
    }

    fn kernel(&self, name: &str) -> CudaFunction {
        self.module.load_function(name).expect("kernel in module")
    }
}

fn blocks(threads: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(block), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn code(e: &DriverError) -> u32 {
    e.code()
        .unwrap_or_else(|| panic!("not the driver's answer: {e}"))
}

/// Scalars in zero-padded 8-byte slots: what a pointer parameter reads from a scalar's
/// address (8 bytes) is then known, instead of the stack's neighbouring bytes.
#[repr(C, align(8))]
struct Slot<T: Copy>(T, u32);

#[test]
fn swapped_arguments_are_refused_at_launch_naming_the_parameter() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let n = Slot(1000u32, 0);
    let factor = Slot(2.5f32, 0);
    let input: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let src = s.clone_htod(&input).unwrap();
    let mut dst = s.alloc_zeros::<f32>(1000).unwrap();
    let scale = gpu.kernel("scale");

    // The right order: scale(src, n, factor, dst).
    let mut launch = s.launch_builder(&scale);
    launch.arg(&src).arg(&n.0).arg(&factor.0).arg(&mut dst);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(1000, 256)) }.expect("the correct launch");
    let got = s.clone_dtoh(&dst).unwrap();
    assert_eq!(got[999], 999.0 * 2.5);

    // Planted: n and src swapped.
    let mut launch = s.launch_builder(&scale);
    launch.arg(&n.0).arg(&src).arg(&factor.0).arg(&mut dst);
    // SAFETY: deliberately wrong: the stand-in must refuse it before anything runs.
    let err = unsafe { launch.launch(blocks(1000, 256)) }.expect_err("the swap is caught");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_VALUE);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("parameter 0 of scale(const float* src") && why.contains("not device memory"),
        "{why}"
    );
    // Refused at launch, not sticky: the context still works.
    s.synchronize().expect("the context is usable");
}

#[test]
fn a_download_read_before_its_stream_is_synchronised_reads_garbage() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let input: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let src = s.clone_htod(&input).unwrap();
    let mut dst = s.alloc_zeros::<f32>(4096).unwrap();
    let want: Vec<f32> = input.iter().map(|v| v * 0.5).collect();
    let mut staging = celer::cuda::pinned::<u8>(&gpu.context, 4096 * 4, false).unwrap();

    let scale = gpu.kernel("scale");
    let (n, factor) = (4096u32, 0.5f32);
    let mut launch = s.launch_builder(&scale);
    launch.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(4096, 256)) }.unwrap();
    let host: &mut [f32] = bytemuck::cast_slice_mut(staging.as_mut_slice());
    s.memcpy_dtoh(&dst, host).unwrap();
    // Planted: read the pinned destination before the stream is synchronised.
    let early: Vec<f32> = host.to_vec();
    assert_ne!(early, want, "read before the sync: must not be the result");
    assert!(
        early.iter().all(|v| v.to_bits() == 0xCBCB_CBCB),
        "the stand-in fills a queued download's pinned destination with 0xCB bytes"
    );
    // The twin: synchronise first.
    s.synchronize().unwrap();
    assert_eq!(host.to_vec(), want);
}

#[test]
fn a_write_past_an_allocation_is_an_illegal_address_and_sticky() {
    let _one = serial();
    let contexts_before;
    {
        let gpu = Gpu::new();
        contexts_before = gpu.standin.counter("contexts_created");
        let s = &gpu.stream;
        let mut dst = s.alloc_zeros::<f32>(1000).unwrap();
        let src = s.alloc_zeros::<f32>(1000).unwrap();
        let (n, value) = (1000u32, 7.0f32);
        // Planted: `if (i > n) return;` lets thread n write dst[n].
        let fill = gpu.kernel("fill_off_by_one");
        let scale = gpu.kernel("scale");
        let mut launch = s.launch_builder(&fill);
        launch.arg(&mut dst).arg(&n).arg(&value);
        // SAFETY: the arguments match the signature; the kernel's own bound is the bug.
        unsafe { launch.launch(blocks(1024, 256)) }.expect("queued: the fault comes when it runs");
        let err = s.synchronize().expect_err("the overrun is caught");
        assert_eq!(code(&err), cu::CUDA_ERROR_ILLEGAL_ADDRESS);
        let why = gpu.standin.last_error();
        assert!(
            why.contains("kernel fill_off_by_one")
                && why.contains("illegal write")
                && why.contains("0 bytes past the end of the 4000-byte allocation"),
            "{why}"
        );
        // Sticky, as on a GPU: the context runs nothing more.
        let mut launch = s.launch_builder(&scale);
        launch.arg(&src).arg(&n).arg(&value).arg(&mut dst);
        // SAFETY: a correct launch; the context refuses it.
        let err = unsafe { launch.launch(blocks(1000, 256)) }.expect_err("sticky");
        assert_eq!(code(&err), cu::CUDA_ERROR_ILLEGAL_ADDRESS);
        // Everything is dropped here: the last release destroys the context.
    }
    // A new context works: what celer's device recovery relies on.
    let gpu = Gpu::new();
    assert!(gpu.standin.counter("contexts_created") > contexts_before);
    let s = &gpu.stream;
    let mut dst = s.alloc_zeros::<f32>(1000).unwrap();
    let src = s.clone_htod(&vec![1.0f32; 1000]).unwrap();
    let (n, factor) = (1000u32, 3.0f32);
    let scale = gpu.kernel("scale");
    let mut launch = s.launch_builder(&scale);
    launch.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(1000, 256)) }.unwrap();
    assert!(s.clone_dtoh(&dst).unwrap().iter().all(|&v| v == 3.0));
}

#[test]
fn a_lane_returning_before_a_warp_shuffle_is_caught() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let input: Vec<u32> = (1..=40).collect();
    let src = s.clone_htod(&input).unwrap();
    let n = 40u32;

    // The twin: every lane takes part in the shuffles.
    let mut out = s.alloc_zeros::<u32>(2).unwrap();
    let sums = gpu.kernel("warp_sums");
    let mut launch = s.launch_builder(&sums);
    launch.arg(&src).arg(&n).arg(&mut out);
    // SAFETY: the arguments match warp_sums' signature; out holds one sum per warp.
    unsafe { launch.launch(blocks(64, 64)) }.unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    assert_eq!(got, vec![(1..=32).sum::<u32>(), (33..=40).sum::<u32>()]);

    // Planted: lanes 40..63 return before the shuffles that name them.
    let early = gpu.kernel("warp_sums_early_return");
    let mut launch = s.launch_builder(&early);
    launch.arg(&src).arg(&n).arg(&mut out);
    // SAFETY: the arguments match the signature; the early return is the bug.
    unsafe { launch.launch(blocks(64, 64)) }.unwrap();
    let err = s.synchronize().expect_err("the early return is caught");
    assert_eq!(code(&err), cu::CUDA_ERROR_LAUNCH_FAILED);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("kernel warp_sums_early_return")
            && why.contains("lane 8 of warp 1")
            && why.contains("returned before __shfl_down_sync(0xffffffff)"),
        "{why}"
    );
}

#[test]
fn shared_memory_and_syncthreads_work_per_block() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let input: Vec<u32> = (0..1000).map(|i| i % 97).collect();
    let src = s.clone_htod(&input).unwrap();
    let n = 1000u32;
    let blocks_of_64 = 1000u32.div_ceil(64);
    let mut out = s.alloc_zeros::<u32>(blocks_of_64 as usize).unwrap();
    let sums = gpu.kernel("block_sums");
    let mut launch = s.launch_builder(&sums);
    launch.arg(&src).arg(&n).arg(&mut out);
    // SAFETY: the arguments match block_sums' signature; out holds one sum per block.
    unsafe { launch.launch(blocks(1000, 64)) }.unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    let want: Vec<u32> = input.chunks(64).map(|c| c.iter().sum()).collect();
    assert_eq!(got, want);
}

#[test]
fn timing_needs_events_made_for_it() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    // An event made without timing (`record_event(None)`): elapsed time between two is refused,
    // as the real driver refuses it (the bug a review of celer's stage timing found).
    let a = s.record_event(None).unwrap();
    let b = s.record_event(None).unwrap();
    let err = a.elapsed_ms(&b).expect_err("untimed events");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_HANDLE);
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let a = s.record_event(timed).unwrap();
    let mut buffer = s.alloc_zeros::<u8>(1 << 20).unwrap();
    s.memset_zeros(&mut buffer).unwrap();
    let b = s.record_event(timed).unwrap();
    b.synchronize().unwrap();
    assert!(a.elapsed_ms(&b).expect("timed events") >= 0.0);
}

#[test]
fn injected_faults_fail_a_launch_or_poison_the_context() {
    let _one = serial();
    {
        let gpu = Gpu::new();
        let s = &gpu.stream;
        let src = s.clone_htod(&[1.0f32; 64]).unwrap();
        let mut dst = s.alloc_zeros::<f32>(64).unwrap();
        let scale = gpu.kernel("scale");
        let (n, factor) = (64u32, 2.0f32);
        let launch = |dst: &mut CudaSlice<f32>| {
            let mut b = s.launch_builder(&scale);
            b.arg(&src).arg(&n).arg(&factor).arg(dst);
            // SAFETY: the arguments match scale's signature; the buffers hold n floats.
            unsafe { b.launch(blocks(64, 64)) }
        };
        gpu.standin.inject(Fault::LaunchFails, 1);
        let err = launch(&mut dst).expect_err("the injected launch failure");
        assert_eq!(code(&err), cu::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
        // Not sticky: the next launch runs.
        launch(&mut dst).expect("the context still works");
        s.synchronize().unwrap();
        gpu.standin.inject(Fault::StickyError, 1);
        launch(&mut dst).expect("queued");
        let err = s.synchronize().expect_err("the injected fault");
        assert_eq!(code(&err), cu::CUDA_ERROR_ILLEGAL_ADDRESS);
        let err = s.alloc_zeros::<f32>(1).expect_err("sticky");
        assert_eq!(code(&err), cu::CUDA_ERROR_ILLEGAL_ADDRESS);
    }
    // Released and retained again: a new context without the error.
    let gpu = Gpu::new();
    gpu.stream.alloc_zeros::<f32>(1).expect("a fresh context");
}

#[test]
fn a_hung_launch_blocks_its_synchronisation_until_released() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = gpu.stream.clone();
    let src = s.clone_htod(&[1.0f32; 64]).unwrap();
    let mut dst = s.alloc_zeros::<f32>(64).unwrap();
    let scale = gpu.kernel("scale");
    let (n, factor) = (64u32, 2.0f32);
    let hung_before = gpu.standin.counter("hung_launches");
    // The twin first: the same launch, not armed, ends.
    {
        let mut b = s.launch_builder(&scale);
        b.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
        // SAFETY: the arguments match scale's signature; the buffers hold n floats.
        unsafe { b.launch(blocks(64, 64)) }.expect("queued");
    }
    s.synchronize().expect("an unarmed launch ends");
    assert_eq!(gpu.standin.counter("hung_launches"), hung_before);
    // Planted: a launch that never ends; the thread synchronising its stream blocks.
    gpu.standin.inject(Fault::Hang, 1);
    {
        let mut b = s.launch_builder(&scale);
        b.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
        // SAFETY: as above.
        unsafe { b.launch(blocks(64, 64)) }.expect("queued");
    }
    let waiting = s.clone();
    let synchronising = std::thread::spawn(move || waiting.synchronize());
    let started = std::time::Instant::now();
    while gpu.standin.counter("hanging_now") == 0 {
        assert!(!synchronising.is_finished(), "the synchronisation ended");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the armed launch never reached the head of its stream"
        );
        std::thread::yield_now();
    }
    assert!(
        !synchronising.is_finished(),
        "the hung launch's synchronisation returned"
    );
    assert_eq!(gpu.standin.counter("hung_launches"), hung_before + 1);
    // Released (a test's control; a GPU has none): it runs as any launch, and the wait ends.
    assert_eq!(gpu.standin.release_hangs(), 1);
    synchronising
        .join()
        .unwrap()
        .expect("the released launch ran");
    assert_eq!(gpu.standin.counter("hanging_now"), 0);
    let out = s.clone_dtoh(&dst).unwrap();
    assert!(out.iter().all(|&x| x == 2.0), "{out:?}");
}

#[test]
fn calls_in_a_context_after_its_error_became_sticky_are_counted() {
    let _one = serial();
    {
        let gpu = Gpu::new();
        let s = &gpu.stream;
        let counted = || gpu.standin.device_counter("calls_in_lost_context", 0);
        let (calls, losses) = (counted(), gpu.standin.device_counter("lost_contexts", 0));
        assert_ne!(calls, u64::MAX, "a counter of device 0");
        let src = s.clone_htod(&[1.0f32; 64]).unwrap();
        let mut dst = s.alloc_zeros::<f32>(64).unwrap();
        let scale = gpu.kernel("scale");
        let (n, factor) = (64u32, 2.0f32);
        // The twin: calls in a healthy context count nothing.
        s.synchronize().unwrap();
        assert_eq!(counted(), calls);
        gpu.standin.inject(Fault::StickyError, 1);
        {
            let mut b = s.launch_builder(&scale);
            b.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
            // SAFETY: the arguments match scale's signature; the buffers hold n floats.
            unsafe { b.launch(blocks(64, 64)) }.expect("queued");
        }
        // The synchronisation that runs the faulting kernel began before the loss: not
        // counted. The loss is.
        let err = s.synchronize().expect_err("the injected fault");
        assert_eq!(code(&err), cu::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(counted(), calls);
        assert_eq!(gpu.standin.device_counter("lost_contexts", 0), losses + 1);
        // Each call after it in the context is counted, one by one.
        for k in 1..=3 {
            // SAFETY: a live stream of the lost context; the call only answers its error.
            let err = unsafe { sys::cuStreamSynchronize(s.cu_stream()) }
                .result()
                .expect_err("sticky");
            assert_eq!(code(&err), cu::CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(counted(), calls + k);
        }
        assert_eq!(
            gpu.standin.device_counter("no_such_counter", 0),
            u64::MAX,
            "an unknown name"
        );
    }
    // Released: a fresh context, where calls count nothing again.
    let gpu = Gpu::new();
    let calls = gpu.standin.device_counter("calls_in_lost_context", 0);
    gpu.stream.alloc_zeros::<f32>(1).expect("a fresh context");
    gpu.stream.synchronize().unwrap();
    assert_eq!(
        gpu.standin.device_counter("calls_in_lost_context", 0),
        calls
    );
}

#[test]
fn counters_count_each_kind_of_call() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let before = gpu.standin.counters();
    let celer_before = celer::cuda::driver::counters();
    // One of each: an allocation (zeroed: a memset), an upload, a copy on the device, a
    // launch, a download into pageable memory (a host wait), a stream, event and context
    // synchronisation, a pinned allocation and its free, a device free, a host
    // registration and its end.
    let mut a = s.alloc_zeros::<f32>(256).unwrap();
    s.memcpy_htod(&[1.0f32; 256], &mut a).unwrap();
    let mut b = s.alloc_zeros::<f32>(256).unwrap();
    s.memcpy_dtod(&a, &mut b).unwrap();
    let scale = gpu.kernel("scale");
    let (n, factor) = (256u32, 2.0f32);
    let mut launch = s.launch_builder(&scale);
    launch.arg(&a).arg(&n).arg(&factor).arg(&mut b);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(256, 64)) }.unwrap();
    let mut host = vec![0.0f32; 256];
    s.memcpy_dtoh(&b, &mut host).unwrap();
    s.synchronize().unwrap();
    s.record_event(None).unwrap().synchronize().unwrap();
    gpu.context.synchronize().unwrap();
    let pinned = celer::cuda::pinned::<u8>(&gpu.context, 4096, false).unwrap();
    drop(pinned);
    drop(a);
    s.synchronize().unwrap();
    let pages = HostPages::new(1);
    // SAFETY: the pages outlive their registration, ended two lines down; no copy uses them.
    unsafe { gpu.context.register_host(pages.at(0), pages.bytes(), 0) }.unwrap();
    // SAFETY: as above.
    unsafe { gpu.context.unregister_host(pages.at(0)) }.unwrap();
    let d = gpu.standin.counters() - before;
    assert_eq!(host, vec![2.0f32; 256]);
    assert_eq!(d.device_allocs, 2, "{d:?}");
    assert_eq!(d.device_frees, 1, "{d:?}");
    assert_eq!((d.memsets, d.memset_bytes), (2, 2 * 1024), "{d:?}");
    assert_eq!((d.htod_copies, d.htod_bytes), (1, 1024), "{d:?}");
    assert_eq!((d.dtod_copies, d.dtod_bytes), (1, 1024), "{d:?}");
    assert_eq!((d.dtoh_copies, d.dtoh_bytes), (1, 1024), "{d:?}");
    assert_eq!((d.launches_enqueued, d.launches_run), (1, 1), "{d:?}");
    assert_eq!(
        (d.pinned_allocs, d.pinned_alloc_bytes, d.pinned_frees),
        (1, 4096, 1),
        "{d:?}"
    );
    assert!(
        d.event_syncs >= 1 && d.ctx_syncs >= 1 && d.stream_syncs >= 2,
        "{d:?}"
    );
    assert_eq!(
        d.host_syncs,
        d.stream_syncs + d.event_syncs + d.ctx_syncs + 1,
        "the pageable download waits too: {d:?}"
    );
    assert_eq!(d.sticky_errors, 0, "{d:?}");
    // celer's own counters (what a check on a real GPU reads) count the same calls.
    let c = celer::cuda::driver::counters() - celer_before;
    assert_eq!(c.launches, d.launches_enqueued, "{c:?}");
    assert_eq!(
        (c.memsets, c.memset_bytes),
        (d.memsets, d.memset_bytes),
        "{c:?}"
    );
    assert_eq!(
        (c.htod_copies, c.htod_bytes),
        (d.htod_copies, d.htod_bytes),
        "{c:?}"
    );
    assert_eq!(
        (c.dtoh_copies, c.dtoh_bytes),
        (d.dtoh_copies, d.dtoh_bytes),
        "{c:?}"
    );
    assert_eq!(
        (c.dtod_copies, c.dtod_bytes),
        (d.dtod_copies, d.dtod_bytes),
        "{c:?}"
    );
    assert_eq!(
        (c.stream_syncs, c.event_syncs, c.context_syncs),
        (d.stream_syncs, d.event_syncs, d.ctx_syncs),
        "{c:?}"
    );
    assert_eq!(
        (c.pinned_allocs, c.pinned_alloc_bytes),
        (d.pinned_allocs, d.pinned_alloc_bytes),
        "{c:?}"
    );
    assert_eq!(
        (c.host_registrations, c.host_registration_bytes),
        (d.host_registers, d.host_register_bytes),
        "{c:?}"
    );
    assert_eq!(c.host_registrations, 1, "{c:?}");
    // Every field is a counter the driver knows.
    for name in celer_cuda_standin::Counters::NAMES {
        assert_ne!(gpu.standin.counter(name), u64::MAX, "{name}");
    }
}

/// Sets the stand-in's execution order until dropped, then puts back the one before (the
/// suite may run with CELER_CUDA_STANDIN_ORDER set).
struct OrderFor {
    standin: &'static StandIn,
    before: String,
}

impl OrderFor {
    fn new(standin: &'static StandIn, order: &str) -> OrderFor {
        let before = standin.order();
        standin
            .set_order(order)
            .expect("an order the stand-in knows");
        OrderFor { standin, before }
    }
}

impl Drop for OrderFor {
    fn drop(&mut self) {
        self.standin
            .set_order(&self.before)
            .expect("the order before");
    }
}

/// Launches `name(src, n, out)` in blocks of 64 over `input` and returns `out`.
fn run_u32_kernel(gpu: &Gpu, name: &str, input: &[u32]) -> Vec<u32> {
    let s = &gpu.stream;
    let src = s.clone_htod(input).unwrap();
    let mut out = s.alloc_zeros::<u32>(input.len()).unwrap();
    let n = input.len() as u32;
    let kernel = gpu.kernel(name);
    let mut launch = s.launch_builder(&kernel);
    launch.arg(&src).arg(&n).arg(&mut out);
    // SAFETY: the arguments match the kernel's (const u32*, u32, u32*); both hold n values.
    unsafe { launch.launch(blocks(n, 64)) }.unwrap();
    s.clone_dtoh(&out).unwrap()
}

#[test]
fn a_missing_syncthreads_is_caught_when_lanes_start_in_reverse() {
    let _one = serial();
    let gpu = Gpu::new();
    let input: Vec<u32> = (1..=200).collect();
    // Thread i of each block reads thread i - 1's value.
    let want: Vec<u32> = (0..200u32)
        .map(|i| if i % 64 == 0 { 0 } else { i })
        .collect();
    {
        // CUDA's thread order: thread i - 1 has finished before thread i starts, so the
        // planted bug goes unseen.
        let _order = OrderFor::new(gpu.standin, "forward");
        assert_eq!(run_u32_kernel(&gpu, "shift_without_sync", &input), want);
        assert_eq!(run_u32_kernel(&gpu, "shift_with_sync", &input), want);
    }
    for order in ["reverse", "random:7"] {
        let _order = OrderFor::new(gpu.standin, order);
        let got = run_u32_kernel(&gpu, "shift_without_sync", &input);
        assert_ne!(got, want, "{order}: the missing __syncthreads is caught");
        // What the neighbour had not written yet: the poison shared memory starts with.
        assert!(got.contains(&0xCDCD_CDCD), "{order}: {got:?}");
        // The twin, with the barrier, is right in every order.
        assert_eq!(
            run_u32_kernel(&gpu, "shift_with_sync", &input),
            want,
            "{order}"
        );
    }
}

#[test]
fn a_kernel_that_depends_on_block_order_is_caught_in_reverse_and_random_order() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let chain = gpu.kernel("chain_blocks");
    let run = |order: &str| {
        let _order = OrderFor::new(gpu.standin, order);
        let mut data = s.alloc_zeros::<u32>(16).unwrap();
        let mut launch = s.launch_builder(&chain);
        launch.arg(&mut data);
        // SAFETY: chain_blocks(u32*) over 16 blocks writes data[0..16).
        unsafe { launch.launch(blocks(16 * 32, 32)) }.unwrap();
        s.clone_dtoh(&data).unwrap()
    };
    let in_order: Vec<u32> = (1..=16).collect();
    assert_eq!(
        run("forward"),
        in_order,
        "blocks in CUDA's order hide the bug"
    );
    for order in ["reverse", "random:7", "random:18446744073709551615"] {
        assert_ne!(
            run(order),
            in_order,
            "{order}: the block-order dependency is caught"
        );
    }
    // The same seed, the same order: a failure can be replayed.
    assert_eq!(run("random:7"), run("random:7"));
    assert_ne!(run("random:7"), run("random:8"));
    // Text the stand-in does not know is refused, the order unchanged.
    let before = gpu.standin.order();
    let err = gpu.standin.set_order("random:-1").expect_err("not a seed");
    assert!(err.contains("random:-1"), "{err}");
    assert_eq!(gpu.standin.order(), before);
}

#[test]
fn shared_memory_holds_poison_when_each_block_starts() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let n = 256u32;
    let input: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let src = s.clone_htod(&input).unwrap();
    let want: Vec<f32> = input.iter().map(|v| v * 2.0).collect();
    let run = |name: &str| {
        let kernel = gpu.kernel(name);
        let mut dst = s.alloc_zeros::<f32>(n as usize).unwrap();
        let factor = 2.0f32;
        let mut launch = s.launch_builder(&kernel);
        launch.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
        // SAFETY: the arguments match (const float*, u32, float, float*); n floats each.
        unsafe { launch.launch(blocks(n, 64)) }.unwrap();
        s.clone_dtoh(&dst).unwrap()
    };
    let _order = OrderFor::new(gpu.standin, "forward");
    // Without the poison, block 1 reads what block 0 left in the shared variable: the
    // planted bug passes, as it did before the stand-in poisoned shared memory.
    let was_on = gpu.standin.set_shared_poison(false);
    let unseen = run("scale_through_shared_once");
    gpu.standin.set_shared_poison(true);
    assert_eq!(unseen, want);
    // With it, every block after the first reads poison.
    let caught = run("scale_through_shared_once");
    gpu.standin.set_shared_poison(was_on);
    assert_eq!(caught[..64], want[..64], "block 0 set the factor");
    assert!(
        caught[64..]
            .iter()
            .zip(&input[64..])
            .all(|(v, x)| *v == x * f32::from_bits(0xCDCD_CDCD)),
        "blocks 1.. read the poison: {:?}",
        &caught[64..72]
    );
    // The twin sets it in every block.
    assert_eq!(run("scale_through_shared"), want);
}

#[test]
fn cross_stream_hazards_are_refused_at_enqueue_naming_both_streams() {
    let _one = serial();
    let gpu = Gpu::new();
    let a = gpu.context.new_stream().unwrap();
    let b = gpu.context.new_stream().unwrap();
    let scale = gpu.kernel("scale");
    let n = 1000u32;
    let input: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let launch =
        |stream: &Arc<CudaStream>, src: &CudaSlice<f32>, factor: f32, dst: &mut CudaSlice<f32>| {
            let mut l = stream.launch_builder(&scale);
            l.arg(src).arg(&n).arg(&factor).arg(dst);
            // SAFETY: the arguments match scale's signature; the buffers hold n floats.
            unsafe { l.launch(blocks(n, 256)) }
        };
    let stream_text = |s: &CudaStream| format!("stream {:p}", s.cu_stream());

    // Planted: a producer on stream a, its consumer on stream b, nothing between them.
    let src = a.clone_htod(&input).unwrap();
    let mut mid = a.alloc_zeros::<f32>(n as usize).unwrap();
    let mut out = b.alloc_zeros::<f32>(n as usize).unwrap();
    launch(&a, &src, 2.0, &mut mid).unwrap();
    gpu.standin.clear_last_error();
    let err = launch(&b, &mid, 3.0, &mut out).expect_err("the hazard is refused");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_VALUE);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("cross-stream hazard")
            && why.contains("kernel scale (launch")
            && why.contains(&format!("on {})", stream_text(&b)))
            && why.contains(&format!("on {})", stream_text(&a)))
            && why.contains("reads through parameter 0")
            && why.contains("4000-byte allocation")
            && why.contains("wrote"),
        "{why}"
    );
    gpu.context.synchronize().unwrap();

    // The twin: stream b waits on an event recorded on a after the producer.
    launch(&a, &src, 2.0, &mut mid).unwrap();
    b.wait(&a.record_event(None).unwrap()).unwrap();
    launch(&b, &mid, 3.0, &mut out).expect("ordered by the event");
    b.synchronize().unwrap();
    let want: Vec<f32> = input.iter().map(|v| v * 6.0).collect();
    assert_eq!(b.clone_dtoh(&out).unwrap(), want);

    // Planted: a write on a of what b read, with nothing ordering it after that read.
    let mut again = b.alloc_zeros::<f32>(n as usize).unwrap();
    launch(&b, &mid, 3.0, &mut again).expect("after the context's synchronisation");
    let err = launch(&a, &src, 5.0, &mut mid).expect_err("write after another stream's read");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_VALUE);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("writes through parameter 3") && why.contains("read"),
        "{why}"
    );
    gpu.context.synchronize().unwrap();

    // The twin: the host synchronised stream a after the producer.
    launch(&a, &src, 4.0, &mut mid).unwrap();
    a.synchronize().unwrap();
    launch(&b, &mid, 0.5, &mut out).expect("ordered by the host's synchronisation");
    assert_eq!(
        b.clone_dtoh(&out).unwrap(),
        input.iter().map(|v| v * 2.0).collect::<Vec<f32>>()
    );
    // Every stream done before the slices are freed on theirs.
    gpu.context.synchronize().unwrap();
}

/// A harness of two "requests" that reuse one scratch buffer: each uploads its input into
/// the scratch buffer (unless `stale`, the planted bug: the second request skips the
/// upload and reads what the first left) and scales it into `out`.
fn two_requests(gpu: &Gpu, stale: bool) -> (Vec<f32>, Vec<f32>) {
    let s = &gpu.stream;
    let n = 512u32;
    let input: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut scratch = s.alloc_zeros::<f32>(n as usize).unwrap();
    let mut out = s.alloc_zeros::<f32>(n as usize).unwrap();
    let scale = gpu.kernel("scale");
    let mut request = |first: bool| {
        if first || !stale {
            s.memcpy_htod(&input, &mut scratch).unwrap();
        }
        let factor = 2.0f32;
        let mut launch = s.launch_builder(&scale);
        launch.arg(&scratch).arg(&n).arg(&factor).arg(&mut out);
        // SAFETY: the arguments match scale's signature; the buffers hold n floats.
        unsafe { launch.launch(blocks(n, 256)) }.unwrap();
        s.clone_dtoh(&out).unwrap()
    };
    gpu.standin.mark_writes();
    let first = request(true);
    // Between the requests: what the first one wrote is poisoned.
    assert!(
        gpu.standin.poison_written(0xCD) >= 2,
        "scratch and out were written"
    );
    let second = request(false);
    (first, second)
}

#[test]
fn device_memory_holds_poison_until_written() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    // Fresh memory is not zero: a read of memory nothing wrote reads poison...
    // SAFETY: read back before anything writes it, which is what is tested.
    let fresh = unsafe { s.alloc::<u32>(64) }.unwrap();
    assert!(s
        .clone_dtoh(&fresh)
        .unwrap()
        .iter()
        .all(|&v| v == 0xCDCD_CDCD));
    // ... and alloc_zeros does write it.
    let zeros = s.alloc_zeros::<u32>(64).unwrap();
    assert!(s.clone_dtoh(&zeros).unwrap().iter().all(|&v| v == 0));

    // Written before the mark (weights, say): kept when what the requests wrote is poisoned.
    let weights = s.clone_htod(&[7u32; 64]).unwrap();
    // Planted: the second request reads the scratch buffer it did not write.
    let (first, second) = two_requests(&gpu, true);
    assert_ne!(first, second, "the stale read is caught");
    assert!(
        second
            .iter()
            .all(|v| v.is_nan() || v.to_bits() == (f32::from_bits(0xCDCD_CDCD) * 2.0).to_bits()),
        "{:?}",
        &second[..4]
    );
    // The twin writes what it reads in each request.
    let (first, second) = two_requests(&gpu, false);
    assert_eq!(first, second);
    assert_eq!(s.clone_dtoh(&weights).unwrap(), vec![7u32; 64]);
    // poison_live poisons everything live, weights included.
    assert!(gpu.standin.poison_live(0xAB) >= 3);
    assert!(s
        .clone_dtoh(&weights)
        .unwrap()
        .iter()
        .all(|&v| v == 0xABAB_ABAB));
}

#[test]
fn launch_bounds_and_block_size_are_checked_at_launch() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let n = 256u32;
    let src = s.clone_htod(&vec![1.5f32; n as usize]).unwrap();
    let mut dst = s.alloc_zeros::<f32>(n as usize).unwrap();
    let bounded = gpu.kernel("scale_bounded");
    let factor = 2.0f32;
    let launch = |dst: &mut CudaSlice<f32>, block: u32| {
        let mut l = s.launch_builder(&bounded);
        l.arg(&src).arg(&n).arg(&factor).arg(dst);
        // SAFETY: the arguments match scale_bounded's signature; the buffers hold n floats.
        unsafe { l.launch(blocks(n, block)) }
    };
    // Planted: 128 threads per block for a kernel of __launch_bounds__(64).
    let err = launch(&mut dst, 128).expect_err("more threads than the launch bounds");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_VALUE);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("kernel scale_bounded")
            && why.contains("a block of 128 threads")
            && why.contains("__launch_bounds__ 64 threads")
            && why.contains("registers per thread")
            && !why.contains("uses 0 registers"),
        "{why}"
    );
    // The twin: 64 threads per block.
    launch(&mut dst, 64).expect("within the bounds");
    assert_eq!(s.clone_dtoh(&dst).unwrap(), vec![3.0f32; n as usize]);
}

/// Set in the processes that settings_from_the_environment starts: what the process is
/// for.
const CHILD: &str = "CELER_STANDIN_CATCHES_CHILD";

#[test]
fn settings_from_the_environment() {
    let name = "settings_from_the_environment";
    let file = std::env::temp_dir().join(format!("celer-poison-{}", std::process::id()));
    match std::env::var(CHILD).as_deref() {
        Err(_) => {
            // Planted: a typo in each setting. cuInit refuses it, naming it.
            for (variable, value) in [
                ("CELER_CUDA_STANDIN_ORDER", "backwards"),
                ("CELER_CUDA_STANDIN_ORDER", "random:"),
                ("CELER_CUDA_STANDIN_HAZARDS", "no"),
                ("CELER_CUDA_STANDIN_POISON_SHARED", "off"),
                ("CELER_CUDA_STANDIN_POISON_DEVICE", "2"),
                ("CELER_CUDA_STANDIN_RETURN", "cuStreamSynchronize=700"),
                ("CELER_CUDA_STANDIN_RETURN", "cuStreamSynchronize:700@0"),
                ("CELER_CUDA_STANDIN_RETURN", "cuNoSuchCall:700"),
            ] {
                celer_cuda_standin::run_test_in_child(
                    name,
                    &[
                        (CHILD, "typo"),
                        (variable, value),
                        ("WANT", &format!("{variable}={value}")),
                    ],
                );
            }
            // The order the variable names, and the poison file's commands.
            celer_cuda_standin::run_test_in_child(
                name,
                &[
                    (CHILD, "file"),
                    ("CELER_CUDA_STANDIN_ORDER", "random:42"),
                    ("CELER_CUDA_STANDIN_POISON_FILE", file.to_str().unwrap()),
                ],
            );
            return;
        }
        Ok("typo") => {
            let standin = standin();
            let err = CudaContext::new(0).expect_err("cuInit refuses the setting");
            assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_VALUE);
            let why = standin.last_error();
            let want = std::env::var("WANT").unwrap();
            assert!(why.contains(&want), "{why}");
            return;
        }
        Ok(_) => {}
    }
    let file = std::path::PathBuf::from(std::env::var("CELER_CUDA_STANDIN_POISON_FILE").unwrap());
    let gpu = Gpu::new();
    assert_eq!(gpu.standin.order(), "random:42");
    let s = &gpu.stream;
    let weights = s.clone_htod(&[1u32; 16]).unwrap();
    let mut scratch = s.alloc_zeros::<u32>(16).unwrap();
    std::fs::write(&file, "mark\n").unwrap();
    // The next enqueue call takes the command (and removes the file), before its own work.
    s.memcpy_htod(&[2u32; 16], &mut scratch).unwrap();
    assert!(!file.exists(), "the command was taken");
    std::fs::write(&file, "poison 0x11").unwrap();
    let mut other = s.alloc_zeros::<u32>(16).unwrap();
    assert!(!file.exists());
    assert_eq!(s.clone_dtoh(&scratch).unwrap(), vec![0x1111_1111u32; 16]);
    assert_eq!(
        s.clone_dtoh(&weights).unwrap(),
        vec![1u32; 16],
        "written before the mark"
    );
    assert_eq!(
        s.clone_dtoh(&other).unwrap(),
        vec![0u32; 16],
        "written after the poison"
    );
    std::fs::write(&file, "poison_live").unwrap();
    s.memcpy_htod(&[3u32; 16], &mut other).unwrap();
    assert_eq!(s.clone_dtoh(&weights).unwrap(), vec![0xCDCD_CDCDu32; 16]);
    assert_eq!(s.clone_dtoh(&other).unwrap(), vec![3u32; 16]);
}

#[test]
fn a_block_needing_more_registers_than_an_sm_has_is_refused() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let src = s.clone_htod(&[1.0f32; 96]).unwrap();
    let mut dst = s.alloc_zeros::<f32>(1024).unwrap();
    let kernel = gpu.kernel("many_registers");
    let launch = |dst: &mut CudaSlice<f32>, block: u32| {
        let mut l = s.launch_builder(&kernel);
        l.arg(&src).arg(dst);
        // SAFETY: the arguments match many_registers(const volatile float*, float*); src
        // holds 96 floats, dst one per thread.
        unsafe { l.launch(blocks(1024, block)) }
    };
    // Planted: 1024 threads of a kernel of about 100 registers each.
    let err = launch(&mut dst, 1024).expect_err("more registers than an SM has");
    assert_eq!(code(&err), cu::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("kernel many_registers")
            && why.contains("a block of 1024 threads needs")
            && why.contains("more than the 65536 of an SM"),
        "{why}"
    );
    // The twin: 128 threads per block.
    launch(&mut dst, 128).expect("fits");
    // 1 + 0.5 + 0.25 + ...: the sum of 96 halvings of 1.
    let want = (0..96).fold(0.0f32, |acc, _| acc * 0.5 + 1.0);
    assert_eq!(s.clone_dtoh(&dst).unwrap(), vec![want; 1024]);
}

/// Page-aligned heap memory of the test's own, as the pool of host buffers that celer
/// page-locks with `cuMemHostRegister`: the memory is the caller's before, during and
/// after its registration.
struct HostPages {
    pointer: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl HostPages {
    const PAGE: usize = 4096;

    /// `pages` zeroed pages.
    fn new(pages: usize) -> HostPages {
        let layout = std::alloc::Layout::from_size_align(pages * Self::PAGE, Self::PAGE)
            .expect("a page-aligned layout");
        assert!(layout.size() > 0);
        // SAFETY: the layout's size is not 0.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let pointer =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        HostPages { pointer, layout }
    }

    fn bytes(&self) -> usize {
        self.layout.size()
    }

    /// The start of the pages, `offset` bytes in, as the driver takes host pointers.
    fn at(&self, offset: usize) -> *mut std::ffi::c_void {
        assert!(offset <= self.bytes());
        // SAFETY: offset is within the allocation (or one past its end).
        unsafe { self.pointer.as_ptr().add(offset) }.cast()
    }

    fn floats(&mut self) -> &mut [f32] {
        // SAFETY: the pages are initialised (zeroed), page-aligned (so f32-aligned), a
        // whole number of f32s, and borrowed mutably with `self`.
        unsafe {
            std::slice::from_raw_parts_mut(self.pointer.as_ptr().cast::<f32>(), self.bytes() / 4)
        }
    }

    /// `cuMemHostRegister_v2` of `bytes` from `offset`, with `flags`.
    fn register_part(&self, offset: usize, bytes: usize, flags: u32) -> Result<(), DriverError> {
        // SAFETY: the range lies in this allocation, which outlives the registration (Drop
        // unregisters before freeing it); the driver only records the range.
        unsafe { sys::cuMemHostRegister_v2(self.at(offset), bytes, flags) }.result()
    }

    fn register(&self) -> Result<(), DriverError> {
        self.register_part(0, self.bytes(), 0)
    }

    fn unregister(&self) -> Result<(), DriverError> {
        host_unregister(self.at(0))
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        // Registered or not (a test may end with it registered, or its context gone): the
        // driver must not keep a range whose memory goes back to the heap.
        let _ = self.unregister();
        // SAFETY: allocated in new with this layout, freed once.
        unsafe { std::alloc::dealloc(self.pointer.as_ptr(), self.layout) }
    }
}

/// `cuMemHostUnregister(pointer)`.
fn host_unregister(pointer: *mut std::ffi::c_void) -> Result<(), DriverError> {
    // SAFETY: the driver looks the pointer up among its registrations and touches no
    // memory.
    unsafe { sys::cuMemHostUnregister(pointer) }.result()
}

#[test]
fn registered_host_memory_is_copied_by_dma_and_unregistered_memory_is_staged() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let mut up = HostPages::new(4);
    let mut down = HostPages::new(4);
    let n = up.bytes() / 4;
    let want: Vec<f32> = (0..n).map(|i| i as f32).collect();
    up.floats().copy_from_slice(&want);
    let mut device = s.alloc_zeros::<f32>(n).unwrap();
    s.synchronize().unwrap();

    let before = gpu.standin.counters();
    up.register().expect("register the upload's pages");
    down.register().expect("register the download's pages");
    s.memcpy_htod(up.floats(), &mut device).unwrap();
    s.memcpy_dtoh(&device, down.floats()).unwrap();
    let d = gpu.standin.counters() - before;
    assert_eq!(
        (d.host_registers, d.host_register_bytes),
        (2, 2 * 4 * 4096),
        "{d:?}"
    );
    assert_eq!((d.htod_copies, d.pageable_htod_copies), (1, 0), "{d:?}");
    assert_eq!((d.dtoh_copies, d.pageable_dtoh_copies), (1, 0), "{d:?}");
    assert_eq!(
        d.host_syncs, 0,
        "DMA into registered memory does not wait: {d:?}"
    );
    // Queued, as DMA into pinned memory: the destination holds garbage until the sync.
    assert!(
        down.floats().iter().all(|v| v.to_bits() == 0xCBCB_CBCB),
        "a queued download into registered memory"
    );
    s.synchronize().unwrap();
    assert_eq!(down.floats(), &want[..]);

    // Unregistered, the same pages are pageable: staged, and the download waits.
    let before = gpu.standin.counters();
    up.unregister().expect("unregister the upload's pages");
    down.unregister().expect("unregister the download's pages");
    down.floats().fill(0.0);
    s.memcpy_htod(up.floats(), &mut device).unwrap();
    s.memcpy_dtoh(&device, down.floats()).unwrap();
    let d = gpu.standin.counters() - before;
    assert_eq!((d.host_unregisters, d.host_registers), (2, 0), "{d:?}");
    assert_eq!((d.htod_copies, d.pageable_htod_copies), (1, 1), "{d:?}");
    assert_eq!((d.dtoh_copies, d.pageable_dtoh_copies), (1, 1), "{d:?}");
    assert_eq!(d.host_syncs, 1, "the pageable download waited: {d:?}");
    assert_eq!(down.floats(), &want[..], "complete when the call returned");
    assert_eq!(d.sticky_errors, 0, "{d:?}");
}

#[test]
fn a_registered_buffer_changed_or_unregistered_while_its_copy_is_queued_is_caught() {
    let _one = serial();
    // The twin: changed only after the sync, unregistered only after the sync.
    {
        let gpu = Gpu::new();
        let s = &gpu.stream;
        let mut host = HostPages::new(1);
        host.floats().fill(3.0);
        let mut device = s.alloc_zeros::<f32>(1024).unwrap();
        host.register().unwrap();
        s.memcpy_htod(host.floats(), &mut device).unwrap();
        s.synchronize().unwrap();
        host.floats()[0] = 4.0;
        s.memcpy_dtoh(&device, host.floats()).unwrap();
        s.synchronize().unwrap();
        host.unregister().unwrap();
        assert_eq!(host.floats(), &[3.0f32; 1024][..]);
    }
    // Planted: each in a fresh context (the error is sticky).
    for planted in ["changed", "unregistered", "unregistered destination"] {
        let gpu = Gpu::new();
        let s = &gpu.stream;
        let mut host = HostPages::new(1);
        let mut device = s.clone_htod(&[1.0f32; 1024]).unwrap();
        s.synchronize().unwrap();
        host.register().unwrap();
        if planted == "unregistered destination" {
            s.memcpy_dtoh(&device, host.floats()).unwrap();
        } else {
            s.memcpy_htod(host.floats(), &mut device).unwrap();
        }
        if planted == "changed" {
            host.floats()[7] = 8.0;
        } else {
            host.unregister()
                .expect("unregistered while its copy is queued");
        }
        let err = s.synchronize().expect_err(planted);
        assert_eq!(code(&err), cu::CUDA_ERROR_ILLEGAL_ADDRESS, "{planted}");
        let why = gpu.standin.last_error();
        let want = match planted {
            "changed" => "cuMemcpyHtoDAsync(",
            "unregistered" => "the pinned source was unregistered (cuMemHostUnregister) while its copy was queued",
            _ => "the pinned destination was unregistered (cuMemHostUnregister) while its copy was queued",
        };
        assert!(why.contains(want), "{planted}: {why}");
        if planted == "changed" {
            assert!(why.contains("the pinned source changed"), "{why}");
        }
    }
}

#[test]
fn overlapping_registrations_unknown_pointers_and_bad_flags_are_refused() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let mut host = HostPages::new(4);
    let other = HostPages::new(1);
    let page = HostPages::PAGE;
    // Planted: a range running into a registration, a part of it, the same range again.
    let already = cu::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    host.register_part(page, page, 0)
        .expect("the second page registered");
    let err = host
        .register()
        .expect_err("all four pages run into the second");
    assert_eq!(code(&err), already);
    let err = host
        .register_part(page + 16, 32, 0)
        .expect_err("inside the second page");
    assert_eq!(code(&err), already);
    let err = host
        .register_part(page, page, 0)
        .expect_err("the same range");
    assert_eq!(code(&err), already);
    host_unregister(host.at(page)).expect("the second page unregistered");
    host.register().expect("then all four pages");
    let mut pinned = celer::cuda::pinned::<u8>(&gpu.context, 4096, false).unwrap();
    let pinned_at = pinned
        .as_mut_slice()
        .as_mut_ptr()
        .cast::<std::ffi::c_void>();
    // SAFETY: the driver only records the range; cuMemHostAlloc's memory must be refused.
    let err = unsafe { sys::cuMemHostRegister_v2(pinned_at, 64, 0) }
        .result()
        .expect_err("memory of cuMemHostAlloc is page-locked already");
    assert_eq!(code(&err), already);
    let why = gpu.standin.last_error();
    assert!(why.contains("memory of cuMemHostAlloc"), "{why}");

    // Planted: unregistering what is not the start of a registration.
    let not_registered = cu::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    let err = host_unregister(host.at(page)).expect_err("inside a registration");
    assert_eq!(code(&err), not_registered);
    let err = other.unregister().expect_err("never registered");
    assert_eq!(code(&err), not_registered);
    let err = host_unregister(pinned_at).expect_err("memory of cuMemHostAlloc");
    assert_eq!(code(&err), not_registered);

    // Planted: cuMemFreeHost of registered memory. Refused, and the memory is untouched
    // (still mapped: written below) and still registered (a copy from it is DMA).
    // SAFETY: the driver must refuse it and unmap nothing.
    let err = unsafe { sys::cuMemFreeHost(host.at(0)) }
        .result()
        .expect_err("not memory of cuMemHostAlloc");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_VALUE);
    host.floats().fill(5.0);
    let mut device = s.alloc_zeros::<f32>(4 * 1024).unwrap();
    let before = gpu.standin.counters();
    s.memcpy_htod(host.floats(), &mut device).unwrap();
    let d = gpu.standin.counters() - before;
    assert_eq!((d.htod_copies, d.pageable_htod_copies), (1, 0), "{d:?}");
    s.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&device).unwrap(), vec![5.0f32; 4 * 1024]);

    // Planted: an undocumented flag, a null pointer, an empty range.
    let invalid = cu::CUDA_ERROR_INVALID_VALUE;
    let err = other.register_part(0, page, 0x10).expect_err("flag 0x10");
    assert_eq!(code(&err), invalid);
    let err = other.register_part(0, 0, 0).expect_err("0 bytes");
    assert_eq!(code(&err), invalid);
    // SAFETY: a null pointer, which the driver must refuse.
    let err = unsafe { sys::cuMemHostRegister_v2(std::ptr::null_mut(), page, 0) }
        .result()
        .expect_err("null");
    assert_eq!(code(&err), invalid);
    // The twin: every documented flag; the range next to a registration.
    other
        .register_part(0, page, 0x1 | 0x2 | 0x4 | 0x8)
        .expect("PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY");
    other.unregister().expect("unregistered");

    host.unregister().expect("unregistered");
    let err = host.unregister().expect_err("twice");
    assert_eq!(code(&err), not_registered);
    host.register()
        .expect("registered again after its unregistration");
    host.unregister().expect("unregistered");
}

#[test]
fn registrations_end_with_the_context_that_made_them() {
    let _one = serial();
    let mut host = HostPages::new(1);
    host.floats().fill(2.0);
    {
        let gpu = Gpu::new();
        let s = &gpu.stream;
        let mut device = s.alloc_zeros::<f32>(1024).unwrap();
        s.synchronize().unwrap();
        host.register_part(0, host.bytes(), 0x1)
            .expect("registered PORTABLE");
        let before = gpu.standin.counters();
        s.memcpy_htod(host.floats(), &mut device).unwrap();
        s.synchronize().unwrap();
        let d = gpu.standin.counters() - before;
        assert_eq!(d.pageable_htod_copies, 0, "registered: {d:?}");
        // SAFETY: device 0 exists; the reset destroys what the handles above refer to,
        // which is then only dropped (celer's driver layer logs the errors of its destroy calls).
        unsafe { sys::cuDevicePrimaryCtxReset_v2(0) }
            .result()
            .expect("reset");
    }
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let mut device = s.alloc_zeros::<f32>(1024).unwrap();
    s.synchronize().unwrap();
    let before = gpu.standin.counters();
    s.memcpy_htod(host.floats(), &mut device).unwrap();
    let d = gpu.standin.counters() - before;
    assert_eq!(
        (d.htod_copies, d.pageable_htod_copies),
        (1, 1),
        "pageable after its context's reset: {d:?}"
    );
    assert_eq!(s.clone_dtoh(&device).unwrap(), vec![2.0f32; 1024]);
    let err = host.unregister().expect_err("ended with its context");
    assert_eq!(code(&err), cu::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("the registration that started here was ended by cuDevicePrimaryCtxReset"),
        "{why}"
    );
    // The memory is the caller's still, and can be registered in the new context.
    host.register().expect("registered in the new context");
    host.unregister().expect("unregistered");
}

/// Set in the process that a_registration_ends_with_its_context_for_every_gpu starts: two
/// stand-in GPUs.
const TWO_GPUS_CHILD: &str = "CELER_STANDIN_CATCHES_TWO_GPUS";

/// Rule "registration ended with its context", across GPUs: memory registered (PORTABLE)
/// in GPU 0's primary context is pageable to GPU 1's copies once that context is reset
/// (planted), counted and noted; registered in a context of one's own on GPU 0 (the twin),
/// it stays DMA through the reset, until that context is destroyed.
#[test]
fn a_registration_ends_with_its_context_for_every_gpu() {
    if std::env::var(TWO_GPUS_CHILD).is_err() {
        // The stand-in reads its GPU count at cuInit: a process of its own.
        celer_cuda_standin::run_test_in_child(
            "a_registration_ends_with_its_context_for_every_gpu",
            &[(TWO_GPUS_CHILD, "1"), ("CELER_CUDA_STANDIN_DEVICES", "2")],
        );
        return;
    }
    let standin = standin();
    let gpu1 = CudaContext::new(1).expect("the stand-in's GPU 1");
    let stream = gpu1.new_stream().unwrap();
    let mut device = stream.alloc_zeros::<f32>(1024).unwrap();
    stream.synchronize().unwrap();
    let mut host = HostPages::new(1);
    host.floats().fill(3.0);
    // One upload on GPU 1 from `host`: (pageable copies, of them after a context's end).
    let mut upload = |host: &mut HostPages| {
        let before = standin.counters();
        stream.memcpy_htod(host.floats(), &mut device).unwrap();
        let d = standin.counters() - before;
        assert_eq!(stream.clone_dtoh(&device).unwrap(), vec![3.0f32; 1024]);
        (d.pageable_htod_copies, d.pageable_after_context_end)
    };
    let portable = sys::CU_MEMHOSTREGISTER_PORTABLE;

    // Planted: registered in GPU 0's primary context, which is then reset.
    let gpu0 = CudaContext::new(0).expect("the stand-in's GPU 0");
    host.register_part(0, host.bytes(), portable)
        .expect("registered in GPU 0's primary context");
    assert_eq!(upload(&mut host), (0, 0), "DMA while registered");
    // SAFETY: device 0 exists; nothing of its primary context is used after the reset.
    unsafe { sys::cuDevicePrimaryCtxReset_v2(0) }
        .result()
        .expect("reset");
    drop(gpu0);
    assert_eq!(
        upload(&mut host),
        (1, 1),
        "pageable on GPU 1 after the reset"
    );
    let note = standin.last_note();
    assert!(
        note.starts_with("registration ended with its context: cuMemcpyHtoDAsync(")
            && note.contains("on GPU 1")
            && note.contains("the primary context of GPU 0, by cuDevicePrimaryCtxReset"),
        "{note}"
    );

    // The twin: registered in a context of its own on GPU 0, which no reset touches. Made
    // with GPU 1's context current, which stays current.
    gpu1.bind_to_thread().unwrap();
    let own = OwnContext::create(Device::get(0).unwrap()).expect("a context of its own");
    assert_eq!(
        celer::cuda::driver::current().unwrap(),
        gpu1.cu_ctx(),
        "still current"
    );
    // SAFETY: `host` outlives the registration (unregistered by the context's destroy
    // below, or by its Drop).
    unsafe { own.register_host(host.at(0), host.bytes(), portable) }
        .expect("registered in its own context");
    assert_eq!(
        celer::cuda::driver::current().unwrap(),
        gpu1.cu_ctx(),
        "still current"
    );
    let gpu0 = CudaContext::new(0).expect("GPU 0's primary context again");
    // SAFETY: as above.
    unsafe { sys::cuDevicePrimaryCtxReset_v2(0) }
        .result()
        .expect("reset");
    drop(gpu0);
    assert_eq!(upload(&mut host), (0, 0), "DMA through GPU 0's reset");
    // Its destruction ends the registration, as any context's.
    drop(own);
    assert_eq!(
        upload(&mut host),
        (1, 1),
        "pageable once that context is gone"
    );
    let note = standin.last_note();
    assert!(
        note.contains("(cuCtxCreate) of GPU 0, by cuCtxDestroy"),
        "{note}"
    );

    // Planted: cuCtxDestroy of a primary context, and a pop with nothing current.
    // SAFETY: the driver must refuse it, destroying nothing.
    let err = unsafe { sys::cuCtxDestroy_v2(gpu1.cu_ctx()) }
        .result()
        .expect_err("a primary context");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_CONTEXT);
    assert!(
        standin
            .last_error()
            .contains("the primary context of GPU 1"),
        "{}",
        standin.last_error()
    );
    // SAFETY: clearing the current context is always allowed.
    unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) }
        .result()
        .unwrap();
    let mut popped = std::ptr::null_mut();
    // SAFETY: the pointer is valid for one write.
    let err = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }
        .result()
        .expect_err("nothing current");
    assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_CONTEXT);
}

/// The driver's version, as the stand-in plays it.
fn driver_version() -> celer::cuda::CudaVersion {
    celer::cuda::probe::driver_version().expect("the driver's version")
}

/// `cuGetErrorName(code)` as the driver answers it: the name, or the error code.
fn error_name(code: u32) -> Result<String, u32> {
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the out-pointer is valid for one write; any integer is a code to ask about.
    let answer = unsafe { sys::cuGetErrorName(code, &mut text) };
    match answer.result() {
        // SAFETY: on success the driver points `text` at a NUL-terminated name it owns.
        Ok(()) => Ok(unsafe { std::ffi::CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()),
        Err(e) => {
            assert!(text.is_null(), "no name for {code}");
            Err(e.code().expect("the driver's answer"))
        }
    }
}

#[test]
fn chosen_return_codes_are_returned_once_or_made_sticky() {
    let _one = serial();
    let contained = cu::CUDA_ERROR_CONTAINED;
    {
        let gpu = Gpu::new();
        let s = &gpu.stream;
        // The twin of what follows: a code that leaves the context usable is returned by
        // the one call it was armed for.
        gpu.standin
            .inject_return("cuMemAllocAsync", cu::CUDA_ERROR_OUT_OF_MEMORY, 1)
            .expect("armed");
        let err = s.alloc_zeros::<f32>(16).expect_err("the injected code");
        assert_eq!(code(&err), cu::CUDA_ERROR_OUT_OF_MEMORY);
        assert!(!err.is_device_lost(), "{err}");
        s.alloc_zeros::<f32>(16).expect("only the one call");
        // A code no cuda.h has: sticky (the context cannot be trusted), on the 2nd call.
        gpu.standin
            .inject_return("cuStreamSynchronize", 1000, 2)
            .expect("a code beyond every header, at any version");
        s.synchronize().expect("the first call is not armed");
        let err = s.synchronize().expect_err("the second is");
        assert_eq!(code(&err), 1000);
        assert!(err.is_device_lost());
        assert!(
            err.to_string().contains("unknown CUDA error code 1000"),
            "{err}"
        );
        let why = gpu.standin.last_error();
        assert!(
            why.contains(
                "cuStreamSynchronize: injected return code 1000 (CELER_CUDA_STANDIN_RETURN)"
            ) && why.contains("sticky"),
            "{why}"
        );
        let err = s.alloc_zeros::<f32>(1).expect_err("sticky");
        assert_eq!(code(&err), 1000);
        // The driver names only the codes its version defines.
        assert_eq!(error_name(1000), Err(cu::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            error_name(cu::CUDA_ERROR_ILLEGAL_ADDRESS).as_deref(),
            Ok("CUDA_ERROR_ILLEGAL_ADDRESS")
        );
    }
    // Planted: entry points the stand-in's version does not export, and CUDA_SUCCESS.
    let standin = standin();
    for entry in ["cuMemcpy3D", "cuNoSuchCall"] {
        let why = standin.inject_return(entry, 1000, 1).expect_err(entry);
        assert!(why.contains(entry) && why.contains("exports"), "{why}");
    }
    let newer = standin.inject_return("cuEventElapsedTime_v2", 1000, 1);
    assert_eq!(
        newer.is_ok(),
        driver_version() >= celer::cuda::CudaVersion::new(12, 8)
    );
    standin.inject_return("cuEventElapsedTime_v2", 1000, 0).ok();
    assert!(standin.inject_return("cuStreamSynchronize", 0, 1).is_err());
    // CUDA_ERROR_CONTAINED exists from CUDA 12.8: an older driver never returns it, so the
    // stand-in refuses it there (planted), and an older driver does not name it.
    let gpu = Gpu::new();
    if driver_version() < celer::cuda::CudaVersion::new(12, 8) {
        let why = gpu
            .standin
            .inject_return("cuStreamSynchronize", contained, 1)
            .expect_err("226 on a driver older than 12.8");
        assert!(
            why.contains("CUDA_ERROR_CONTAINED (226) is CUDA 12.8's")
                && why.contains("never returns it"),
            "{why}"
        );
        assert_eq!(error_name(contained), Err(cu::CUDA_ERROR_INVALID_VALUE));
        gpu.stream.synchronize().expect("nothing was armed");
    } else {
        assert_eq!(error_name(contained).as_deref(), Ok("CUDA_ERROR_CONTAINED"));
        gpu.standin
            .inject_return("cuStreamSynchronize", contained, 1)
            .expect("226 from CUDA 12.8 on");
        let err = gpu.stream.synchronize().expect_err("contained");
        assert_eq!(code(&err), contained);
        assert!(err.is_device_lost());
        assert!(
            err.to_string().contains("CUDA_ERROR_CONTAINED (226)"),
            "{err}"
        );
        let err = gpu.stream.alloc_zeros::<u8>(1).expect_err("sticky");
        assert_eq!(code(&err), contained);
    }
}

/// Set in the process that chosen_return_codes_from_the_environment starts.
const RETURN_CHILD: &str = "CELER_STANDIN_RETURN_CHILD";

#[test]
fn chosen_return_codes_from_the_environment() {
    let name = "chosen_return_codes_from_the_environment";
    if std::env::var(RETURN_CHILD).is_err() {
        let version = celer_cuda_standin::version();
        // 226 where the stand-in's version has it; a code no cuda.h has otherwise.
        let later = if version >= "12.8" { "226" } else { "1000" };
        celer_cuda_standin::run_test_in_child(
            name,
            &[
                (RETURN_CHILD, later),
                (
                    "CELER_CUDA_STANDIN_RETURN",
                    &format!("cuMemAllocAsync:2,cuStreamSynchronize:{later}@2"),
                ),
            ],
        );
        if version < "12.8" {
            // Planted: 226 named for a driver that predates it. cuInit refuses it.
            celer_cuda_standin::run_test_in_child(
                name,
                &[
                    (RETURN_CHILD, "refused"),
                    ("CELER_CUDA_STANDIN_RETURN", "cuStreamSynchronize:226"),
                ],
            );
        }
        return;
    }
    let wanted = std::env::var(RETURN_CHILD).unwrap();
    let standin = standin();
    if wanted == "refused" {
        let err = CudaContext::new(0).expect_err("cuInit refuses the setting");
        assert_eq!(code(&err), cu::CUDA_ERROR_INVALID_VALUE);
        let why = standin.last_error();
        assert!(
            why.contains("CELER_CUDA_STANDIN_RETURN=cuStreamSynchronize:226")
                && why.contains("is CUDA 12.8's"),
            "{why}"
        );
        return;
    }
    let later: u32 = wanted.parse().unwrap();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let err = s
        .alloc_zeros::<f32>(4)
        .expect_err("the first cuMemAllocAsync");
    assert_eq!(code(&err), cu::CUDA_ERROR_OUT_OF_MEMORY);
    s.alloc_zeros::<f32>(4).expect("the second");
    s.synchronize().expect("the first cuStreamSynchronize");
    let err = s.synchronize().expect_err("the second");
    assert_eq!(code(&err), later);
    assert!(err.is_device_lost(), "{err}");
}
