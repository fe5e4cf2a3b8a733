//! A GPU request at its floor, counted: the stand-in CUDA driver counts every launch,
//! memset, copy (and its bytes), host synchronisation and pinned allocation, and this test
//! pins, for a 1920x1080 request served from TensorRT engines (U2NetP, built now by the
//! stand-in TensorRT), exactly what the request path is designed to do. A change that adds
//! a copy, a launch or a synchronisation to the request path fails here, and says which
//! count moved; when a change removes work on purpose, the numbers here move with it.
//!
//! The design, for a cut-out: one upload (the RGB8 pixels, DMA from the page-locked block
//! the decoder wrote), one download (the RGBA answer, DMA into a block the encoder reads
//! as it is: its alpha is the matte, so no separate alpha), one host synchronisation (the
//! download's), nothing pinned, nothing staged by the driver; for an alpha answer the
//! download is the alpha plane.
//! Runs on the stand-in only (the counters are its own); on a real GPU it fails, saying
//! so.

mod common;
mod engine_support;
mod gpu_support;
mod serve_support;
mod trt_support;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

use celer::codec::decode::{decode_into, DecodeLimits};
use celer::cuda::HostPool;
use celer::matte::{Planes, StageTimings};
use celer::pixels::HostAlloc;
use celer::pixels::RgbPixels;
use celer::replica::gpu::{host_pool, GpuLimits, GpuStages, DEFAULT_BLOCK_PIXELS};
use celer_cuda_standin::StandIn;
use image::{Rgb, RgbImage};

const W: u32 = 1920;
const H: u32 = 1080;

/// The counters a request moves, by name (driver.cpp's `celer_standin_counter`).
const COUNTED: [&str; 14] = [
    "launches_enqueued",
    "memsets",
    "htod_copies",
    "htod_bytes",
    "dtoh_copies",
    "dtoh_bytes",
    "stream_syncs",
    "event_syncs",
    "ctx_syncs",
    "host_syncs",
    "pinned_allocs",
    "host_registers",
    "pageable_htod_copies",
    "pageable_dtoh_copies",
];

/// The counters are the process's: one test counts at a time.
fn counting_alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE.lock().unwrap_or_else(|p| p.into_inner())
}

fn standin() -> &'static StandIn {
    gpu_support::driver().standin().expect(
        "the request-floor counts are the stand-in CUDA driver's: run on it \
         (CELER_TEST_CUDA=standin), not on a real GPU",
    )
}

fn counters(s: &StandIn) -> BTreeMap<&'static str, u64> {
    COUNTED
        .iter()
        .map(|&name| {
            let value = s.counter(name);
            assert_ne!(value, u64::MAX, "the stand-in has no counter `{name}`");
            (name, value)
        })
        .collect()
}

/// What one request of `planes` moved, by counter.
fn one_request(
    stages: &mut GpuStages,
    image: &Arc<RgbPixels>,
    planes: Planes,
) -> BTreeMap<&'static str, u64> {
    let s = standin();
    let before = counters(s);
    let out = stages
        .run(image, planes, &mut StageTimings::default())
        .expect("served");
    let after = counters(s);
    assert_eq!(out.cutout.is_some(), planes.cutout);
    assert_eq!(out.alpha.is_some(), planes.alpha);
    assert_eq!(out.trimap.is_some(), planes.trimap);
    // The encoder reads the blocks the download wrote: no copy of the answer on the host.
    for (name, leased) in [
        (
            "cut-out",
            out.cutout.as_ref().map(|p| p.as_raw().is_leased()),
        ),
        ("alpha", out.alpha.as_ref().map(|p| p.as_raw().is_leased())),
        (
            "trimap",
            out.trimap.as_ref().map(|p| p.as_raw().is_leased()),
        ),
    ] {
        assert_ne!(
            leased,
            Some(false),
            "{planes:?}: the {name} is not in a pool block"
        );
    }
    let moved: BTreeMap<_, _> = after.iter().map(|(k, v)| (*k, v - before[k])).collect();
    let _ = writeln!(std::io::stderr(), "{planes:?}: {moved:?}");
    moved
}

/// One replica's host pool, its blocks of `block_pixels` RGBA pixels.
fn pool_of(block_pixels: u64) -> HostPool {
    host_pool(1, GpuLimits::default().max_pixels, block_pixels)
}

/// U2NetP's stages on engines built now by the stand-in TensorRT, their downloads into
/// `pool`.
fn u2netp_on_engines(pool: &HostPool) -> (GpuStages, tempfile::TempDir) {
    engine_support::stages_on_engines(
        &engine_support::repo("onnx/u2netp"),
        GpuLimits::default(),
        pool,
    )
}

/// `image` sent as PNG and decoded into `pool`, as a GPU server's decoder does.
fn decoded(image: &RgbImage, pool: &HostPool) -> Arc<RgbPixels> {
    Arc::new(decode_into(&png(image), &DecodeLimits::default(), pool).expect("decoded"))
}

/// `image` as PNG bytes: what a client sends.
fn png(image: &RgbImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut out, image::ImageFormat::Png)
        .expect("PNG");
    out.into_inner()
}

fn photo() -> RgbImage {
    RgbImage::from_fn(W, H, photo_pixel)
}

fn photo_pixel(x: u32, y: u32) -> Rgb<u8> {
    let inside = (600..1300).contains(&x) && (200..900).contains(&y);
    let v = if inside { 210 } else { 40 };
    Rgb([v, (v as u32 + x % 17) as u8, (v as u32 + y % 13) as u8])
}

/// A size's first request uploads only its pixels: its resize tables are made on the
/// device (tables.cu), whether the size was run at load (`--warmup-size`) or never seen.
#[test]
fn a_sizes_first_request_uploads_only_its_pixels() {
    let _alone = counting_alone();
    let _ = standin();
    let pool = pool_of(DEFAULT_BLOCK_PIXELS);
    let (mut stages, _engines) = u2netp_on_engines(&pool);
    let image = decoded(&photo(), &pool);
    let cold = one_request(&mut stages, &image, Planes::CUTOUT);
    assert_eq!(cold["htod_copies"], 1, "a size never seen: {cold:?}");
    stages.warm_up_at(&[(1280, 720)]).expect("warm-up");
    let small = RgbImage::from_fn(1280, 720, photo_pixel);
    let small = decoded(&small, &pool);
    let warm = one_request(&mut stages, &small, Planes::CUTOUT);
    assert_eq!(warm["htod_copies"], 1, "a size run at load: {warm:?}");
}

#[test]
fn a_1920x1080_request_copies_once_each_way_and_synchronises_once() {
    let _alone = counting_alone();
    let _ = standin();
    let pool = pool_of(DEFAULT_BLOCK_PIXELS);
    let (mut stages, _engines) = u2netp_on_engines(&pool);
    // Decoded into the pool's page-locked blocks, as a GPU server's decoder does.
    let image = decoded(&photo(), &pool);
    assert!(image.as_raw().is_leased(), "decoded into a pool block");
    // The first request of a size makes its resize tables on the device (and launches
    // its kernels at their grid sizes for the first time); every later one of that size
    // finds them in place.
    stages
        .run(&image, Planes::ALL, &mut StageTimings::default())
        .expect("the first request");

    let pixels = u64::from(W * H);
    let cutout = one_request(&mut stages, &image, Planes::CUTOUT);
    let alpha = one_request(&mut stages, &image, Planes::ALPHA);
    for (what, moved, down_bytes) in [("cut-out", &cutout, 4 * pixels), ("alpha", &alpha, pixels)] {
        assert_eq!(
            moved["htod_copies"], 1,
            "{what}: one upload, the RGB pixels"
        );
        assert_eq!(
            moved["htod_bytes"],
            3 * pixels,
            "{what}: the RGB pixels' bytes"
        );
        assert_eq!(moved["dtoh_copies"], 1, "{what}: one download");
        assert_eq!(
            moved["dtoh_bytes"], down_bytes,
            "{what}: the answer's bytes only"
        );
        // Every wait of the host: stream, event and context synchronisations, and copies
        // that return only once their stream ran them.
        assert_eq!(
            moved["host_syncs"], 1,
            "{what}: one host synchronisation: {moved:?}"
        );
        assert_eq!(
            moved["pinned_allocs"], 0,
            "{what}: nothing pinned on the request path"
        );
        // Both copies DMA between the device and the blocks the decoder wrote and the
        // encoder reads: none staged through the driver's pageable buffers, the only
        // other way a host copy of the pixels could be made on the way.
        assert_eq!(
            (moved["pageable_htod_copies"], moved["pageable_dtoh_copies"]),
            (0, 0),
            "{what}: every copy DMA from page-locked blocks"
        );
    }
    // The launches and memsets the design makes (docs/gpu.md lists them): any change is
    // a change to the request path, to be made here on purpose.
    assert_eq!(
        (cutout["launches_enqueued"], cutout["memsets"]),
        (LAUNCHES_CUTOUT, MEMSETS),
        "cut-out: launches and memsets"
    );
    assert_eq!(
        (alpha["launches_enqueued"], alpha["memsets"]),
        (LAUNCHES_ALPHA, MEMSETS),
        "alpha: launches and memsets"
    );
}

/// Kernel launches of one 1920x1080 request on U2NetP's pipeline.
const LAUNCHES_CUTOUT: u64 = 18;
const LAUNCHES_ALPHA: u64 = 18;
/// Device memsets of one request.
const MEMSETS: u64 = 1;

/// A request's pixels cross the bus between page-locked host blocks and the device, and
/// the pool they come from never pins on the request path: its blocks are made at start-up
/// (page-locked when a GPU's context attaches them); a request the free blocks cannot
/// serve gets the heap (copied through the driver's staging) and a block of its size is
/// pinned in the background, which a later request of that size is served from, to the
/// same bits.
#[test]
fn pixel_blocks_are_page_locked_at_load_and_grown_in_the_background() {
    let _alone = counting_alone();
    let s = standin();
    // Four blocks of a 640x480 cut-out and room to grow (not the server's rule, whose
    // start-up blocks hold a 12 MP request: the growth is what is tested here).
    let block = 4 * 640 * 480;
    let pool = HostPool::new(4, block, 16 * block);
    let at_load = pool.stats();
    assert_eq!(
        (at_load.blocks, at_load.bytes),
        (4, 4 * (4 * 640 * 480usize).next_multiple_of(4096)),
        "made at start-up"
    );
    let (mut stages, _engines) = u2netp_on_engines(&pool);
    let pageable = || s.counter("pageable_htod_copies") + s.counter("pageable_dtoh_copies");
    // One cut-out of `w` x `h`, decoded into the pool as a server's decoder does: whether
    // its image got a block, how many copies the driver staged through pageable memory,
    // the cut-out.
    let mut run = |w: u32, h: u32| {
        let photo = RgbImage::from_fn(w, h, |x, y| photo_pixel(x * W / w, y * H / h));
        let image = decoded(&photo, &pool);
        let before = pageable();
        let got = stages
            .run(&image, Planes::CUTOUT, &mut StageTimings::default())
            .expect("served");
        let staged = pageable() - before;
        let cutout = got.cutout.expect("cut-out").into_raw().into_vec();
        (image.as_raw().is_leased(), staged, cutout)
    };
    run(640, 480);
    let (leased, staged, _) = run(640, 480);
    assert!(leased, "640x480 decodes into a block");
    assert_eq!(staged, 0, "640x480: both copies DMA");
    // Larger than the blocks: served from the heap, a block pinned meanwhile.
    let (leased, staged, from_heap) = run(1280, 720);
    assert!(!leased, "1280x720 is larger than the blocks");
    assert!(staged > 0, "1280x720 from the heap, staged by the driver");
    let mut served_from_blocks = false;
    for _ in 0..200 {
        let (leased, staged, cutout) = run(1280, 720);
        assert!(
            cutout == from_heap,
            "the same cut-out from blocks as from the heap"
        );
        if (leased, staged) == (true, 0) {
            served_from_blocks = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        served_from_blocks,
        "no 1280x720 request was served from page-locked blocks: {:?}",
        pool.stats()
    );
    let grown = pool.stats();
    assert!(grown.blocks > at_load.blocks, "{grown:?}");
}

/// What `moved` must be for a cut-out of `pixels` that changed the replica's image size:
/// the floor of a repeated size (one copy each way, DMA, one host synchronisation,
/// nothing pinned or registered while it runs); its resize tables are made on the
/// device, so it launches `TABLE_LAUNCHES` kernels more than a repeated size.
fn assert_size_change_at_the_floor(what: &str, moved: &BTreeMap<&str, u64>, pixels: u64) {
    let expected = [
        ("htod_copies", 1),
        ("htod_bytes", 3 * pixels),
        ("dtoh_copies", 1),
        ("dtoh_bytes", 4 * pixels),
        ("host_syncs", 1),
        ("pageable_htod_copies", 0),
        ("pageable_dtoh_copies", 0),
        ("pinned_allocs", 0),
        ("host_registers", 0),
    ];
    for (name, value) in expected {
        assert_eq!(moved[name], value, "{what}: {name}: {moved:?}");
    }
}

/// Kernels a size change launches to make its resize tables on U2NetP's pipeline
/// (guided filter, subsample 4): the preprocess's two axes, the trimap's NEAREST indices
/// (one launch, both axes), the guided filter's mask resize and guide (two axes each) and
/// its upsampling (two axes).
const TABLE_LAUNCHES: u64 = 9;

/// A size change costs what a repeated size does, plus the launches that make its
/// tables: a 1920x1080 cut-out after a 1024x768 one, and a 4032x3024 cut-out (12 MP:
/// its blocks made at start-up by the server's pool rule) after a 1920x1080 one.
#[test]
fn a_size_change_copies_once_each_way_and_pins_nothing() {
    let _alone = counting_alone();
    let _ = standin();
    let pool = pool_of(DEFAULT_BLOCK_PIXELS);
    let (mut stages, _engines) = u2netp_on_engines(&pool);
    let small = decoded(&RgbImage::from_fn(1024, 768, photo_pixel), &pool);
    let hd = decoded(&photo(), &pool);
    let large = RgbImage::from_fn(4032, 3024, |x, y| photo_pixel(x * W / 4032, y * H / 3024));
    let large = decoded(&large, &pool);
    for (name, image) in [
        ("1024x768", &small),
        ("1920x1080", &hd),
        ("4032x3024", &large),
    ] {
        assert!(
            image.as_raw().is_leased(),
            "{name} decoded into a pool block"
        );
    }
    // Each size once, so that what is counted below is a change of size, not a first
    // kernel launch at a grid size.
    for image in [&large, &small, &hd] {
        one_request(&mut stages, image, Planes::CUTOUT);
    }
    let repeated = one_request(&mut stages, &hd, Planes::CUTOUT);
    one_request(&mut stages, &small, Planes::CUTOUT);
    let to_hd = one_request(&mut stages, &hd, Planes::CUTOUT);
    assert_size_change_at_the_floor("1920x1080 after 1024x768", &to_hd, u64::from(W * H));
    let to_large = one_request(&mut stages, &large, Planes::CUTOUT);
    assert_size_change_at_the_floor("4032x3024 after 1920x1080", &to_large, 4032 * 3024);
    assert_eq!(
        to_hd["launches_enqueued"],
        repeated["launches_enqueued"] + TABLE_LAUNCHES,
        "a size change launches its table kernels: {to_hd:?} against {repeated:?}"
    );
    assert_eq!(to_hd["memsets"], repeated["memsets"]);
}

/// The server's pool holds a 12 MP request's two blocks from start-up: leasing its RGB8
/// pixels and its RGBA answer (after a 1080p request's) pins nothing and misses nothing.
#[test]
fn the_servers_pool_holds_a_12_mp_request_from_start_up() {
    let pool = host_pool(1, GpuLimits::default().max_pixels, DEFAULT_BLOCK_PIXELS);
    let hd_pixels = pool.alloc(3 * (W * H) as usize);
    let hd_answer = pool.alloc(4 * (W * H) as usize);
    let large_pixels = pool.alloc(3 * 4032 * 3024);
    let large_answer = pool.alloc(4 * 4032 * 3024);
    for (what, block) in [
        ("1080p pixels", &hd_pixels),
        ("1080p answer", &hd_answer),
        ("12 MP pixels", &large_pixels),
        ("12 MP answer", &large_answer),
    ] {
        assert!(block.is_leased(), "{what}: {:?}", pool.stats());
    }
    assert_eq!(pool.stats().misses, 0);
}

/// The same floor counted from outside: `celer serve --devices 0 --replicas 1
/// --build-engines` (the binary, over HTTP, with the stand-in TensorRT), its stand-in
/// driver writing every counter to a file at each host synchronisation
/// (CELER_CUDA_STANDIN_COUNTERS_FILE), read after each response.
#[test]
fn a_server_serves_a_size_change_at_the_floor() {
    let _ = standin();
    assert!(
        trt_support::is_standin(),
        "the counts are the stand-ins': run on the stand-in CUDA driver and TensorRT"
    );
    let dir = tempfile::tempdir().expect("a folder");
    let source = common::model_dir("u2netp");
    for file in ["celer.toml", "u2netp.onnx"] {
        std::fs::copy(source.join(file), dir.path().join(file)).expect("the model");
    }
    let counts = dir.path().join("counters");
    let counts_env = counts.to_str().expect("a UTF-8 path").to_string();
    let mut command = serve_support::Server::command(
        dir.path(),
        ["--devices", "0", "--replicas", "1", "--build-engines"],
        &[
            ("CELER_CUDA_STANDIN_QUIET", "1"),
            ("CELER_CUDA_STANDIN_COUNTERS_FILE", &counts_env),
            // A 12 MP photo and its cut-out are larger than the realtime defaults.
            ("CELER_MAX_BODY_BYTES", "100000000"),
            ("CELER_MAX_RESPONSE_BYTES", "100000000"),
        ],
    );
    trt_support::use_tensorrt(&mut command);
    let server = serve_support::Server::spawn(command, std::time::Duration::from_secs(300));
    // Until the engine is built, the CPU serves: count only once the GPU took over.
    server.wait_for_log(
        "the interim device takes no new request",
        std::time::Duration::from_secs(300),
    );
    let read = || -> BTreeMap<String, u64> {
        let text = std::fs::read_to_string(&counts).expect("the stand-in's counters file");
        text.lines()
            .filter_map(|l| {
                let (name, value) = l.split_once(' ')?;
                Some((name.to_string(), value.parse().ok()?))
            })
            .collect()
    };
    let small = png(&RgbImage::from_fn(1024, 768, photo_pixel));
    let hd = std::fs::read(common::fetched("photo-1920x1080.jpg")).expect("the photo");
    let large = std::fs::read(common::fetched("photo-4032x3024.jpg")).expect("the photo");
    let send = |body: &[u8], kind: &str| -> BTreeMap<&'static str, u64> {
        let before = read();
        let answer = server.post("/invocations", &[("Content-Type", kind)], body);
        assert_eq!(answer.status, 200, "{}", server.log());
        let after = read();
        COUNTED
            .iter()
            .map(|&name| (name, after[name] - before[name]))
            .collect()
    };
    // Each size once first (its first launches at its grid sizes), then the changes.
    send(&large, "image/jpeg");
    send(&small, "image/png");
    send(&hd, "image/jpeg");
    send(&small, "image/png");
    let to_hd = send(&hd, "image/jpeg");
    assert_size_change_at_the_floor("served: 1920x1080 after 1024x768", &to_hd, 1920 * 1080);
    let to_large = send(&large, "image/jpeg");
    assert_size_change_at_the_floor("served: 4032x3024 after 1920x1080", &to_large, 4032 * 3024);
    let served = String::from_utf8(server.get("/metrics").1).expect("metrics text");
    assert!(
        served
            .lines()
            .any(|l| l.starts_with("celer_inference_request_success") && l.contains("gpu0")),
        "served on the GPU: {served}"
    );
    server.stop_cleanly();
}
