//! The pipeline on real models against an independent reference, and the two-model graph
//! on the fixtures.
//!
//! Reference: `scripts/reference.py` runs the same pipeline with PIL, numpy and the
//! onnxruntime Python package (`make reference` writes its outputs). Tolerance, at the
//! source size: mask IoU >= 0.99 and mean |alpha difference| <= 2/255. Why not exact:
//! JPEG decoders differ (the `image` crate and libjpeg disagree by up to 4 LSB on ~9 % of
//! values), and U2NetP's trimap thresholds amplify those into a few flipped pixels along
//! the boundary. For PNG inputs, where decoding is exact and our resize is PIL's to the
//! bit, the test holds the pipeline to a far tighter bound.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use celer::codec::decode::{decode, DecodeLimits};
use celer::matte::StageTimings;
use celer::pixels::{GrayPixels, RecyclingHeap};
use celer::replica::cpu::{cpu_cores, CpuStages};
use celer::spec::PipelineSpec;
use image::{GrayImage, Rgb, RgbImage};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn require(path: &Path) -> &Path {
    assert!(
        path.exists(),
        "{} is missing: run `make reference` (it fetches the models and test images and writes the reference outputs)",
        path.display()
    );
    path
}

fn load(dir: &str) -> CpuStages {
    let spec = PipelineSpec::load_dir(&repo(dir)).expect("pipeline description");
    for (_, model) in spec.model_keys() {
        require(model);
    }
    CpuStages::load(&spec, 2).expect("models load")
}

struct Agreement {
    iou: f64,
    mean_abs_diff: f64,
}

fn compare(alpha: &GrayPixels, reference: &GrayImage) -> Agreement {
    assert_eq!(alpha.dimensions(), reference.dimensions());
    let (mut inter, mut union, mut diff) = (0u64, 0u64, 0u64);
    for (&a, &r) in alpha.as_raw().iter().zip(reference.as_raw().iter()) {
        let (fa, fr) = (a >= 128, r >= 128);
        inter += u64::from(fa && fr);
        union += u64::from(fa || fr);
        diff += u64::from(a.abs_diff(r));
    }
    Agreement {
        iou: if union == 0 {
            1.0
        } else {
            inter as f64 / union as f64
        },
        mean_abs_diff: diff as f64 / alpha.as_raw().len() as f64,
    }
}

#[test]
fn u2netp_matches_the_python_reference() {
    let mut pipeline = load("onnx/u2netp");
    let fetched = repo("tests/data/fetched");
    for (name, exact_decode) in [
        ("astronaut.png", true),
        ("chelsea.png", true),
        ("photo-1920x1080.jpg", false),
        ("chelsea-exif6.jpg", false),
    ] {
        let bytes = std::fs::read(require(&fetched.join(name))).unwrap();
        let image = decode(&bytes, &DecodeLimits::default()).unwrap();
        let stem = name.split('.').next().unwrap();
        let reference_path = fetched.join(format!("reference/{stem}.alpha.png"));
        let reference = image::open(require(&reference_path)).unwrap().into_luma8();
        let matte = pipeline
            .run(&image, &mut StageTimings::default())
            .expect("pipeline runs");
        let a = compare(&matte.alpha, &reference);
        println!(
            "{name}: IoU {:.5}, mean |diff| {:.4}/255",
            a.iou, a.mean_abs_diff
        );
        assert!(a.iou >= 0.99, "{name}: mask IoU {} < 0.99", a.iou);
        assert!(
            a.mean_abs_diff <= 2.0,
            "{name}: mean |alpha diff| {}/255 > 2/255",
            a.mean_abs_diff
        );
        if exact_decode {
            assert!(a.iou >= 0.999, "{name}: PNG input, IoU {}", a.iou);
            assert!(
                a.mean_abs_diff <= 0.1,
                "{name}: PNG input, mean |diff| {}/255",
                a.mean_abs_diff
            );
        }
        // The trimap at source size holds only the three values.
        assert!(matte.trimap.iter().all(|v| [0, 128, 255].contains(v)));
    }
}

#[test]
fn exif_orientation_gives_the_upright_image() {
    let fetched = repo("tests/data/fetched");
    let upright = image::open(require(&fetched.join("chelsea.png")))
        .unwrap()
        .into_rgb8();
    let bytes = std::fs::read(require(&fetched.join("chelsea-exif6.jpg"))).unwrap();
    let rotated = decode(&bytes, &DecodeLimits::default()).unwrap();
    assert_eq!(rotated.dimensions(), upright.dimensions());
    // Same picture up to JPEG loss: mean difference of a few levels, not a rotation's.
    let diff: u64 = rotated
        .as_raw()
        .iter()
        .zip(upright.as_raw())
        .map(|(a, b)| u64::from(a.abs_diff(*b)))
        .sum();
    let mean = diff as f64 / upright.as_raw().len() as f64;
    assert!(
        mean < 6.0,
        "mean difference {mean}: not the upright picture"
    );
}

/// seg3.onnx: class from the channel mean m of the input scaled to [0, 1]:
/// 0 when m < 1/3, 2 when m > 2/3, 1 between. matting.onnx: clip(0.75 t + 0.25 m).
#[test]
fn two_model_graph_on_fixtures_gives_the_analytic_alpha() {
    let mut pipeline = load("onnx/fixtures/classes-matting");
    // Left third dark (class 0), middle grey (class 1), right third bright (class 2).
    let (w, h) = (96u32, 40u32);
    let image = RgbImage::from_fn(w, h, |x, _| match x * 3 / w {
        0 => Rgb([20, 20, 20]),
        1 => Rgb([128, 128, 128]),
        _ => Rgb([240, 240, 240]),
    });
    let matte = pipeline.run(&image, &mut StageTimings::default()).unwrap();
    assert_eq!(matte.alpha.dimensions(), (w, h));
    let alpha_at = |x: u32| matte.alpha.get_pixel(x, h / 2)[0];
    let trimap_at = |x: u32| matte.trimap.get_pixel(x, h / 2)[0];
    // Interiors, away from the eroded boundaries.
    assert_eq!(trimap_at(5), 0);
    assert_eq!(trimap_at(48), 128);
    assert_eq!(trimap_at(90), 255);
    let expect = |t: f32, m: f32| ((0.75 * t + 0.25 * m).clamp(0.0, 1.0) * 255.0).round() as u8;
    assert_eq!(alpha_at(5), expect(0.0, 20.0 / 255.0));
    assert_eq!(alpha_at(48), expect(128.0 / 255.0, 128.0 / 255.0));
    assert_eq!(alpha_at(90), expect(1.0, 240.0 / 255.0));
}

#[test]
fn probability_fixture_with_guided_filter_cuts_out_the_bright_square() {
    let mut pipeline = load("onnx/fixtures/prob-guided");
    let (w, h) = (120u32, 90u32);
    let image = RgbImage::from_fn(w, h, |x, y| {
        if (30..90).contains(&x) && (20..70).contains(&y) {
            Rgb([250, 250, 250])
        } else {
            Rgb([5, 5, 5])
        }
    });
    let matte = pipeline.run(&image, &mut StageTimings::default()).unwrap();
    assert_eq!(matte.alpha.get_pixel(60, 45)[0], 255, "inside the square");
    assert_eq!(matte.alpha.get_pixel(5, 5)[0], 0, "background");
    // The edge follows the image's edge: alpha crosses 128 within a pixel of x = 30.
    let row: Vec<u8> = (0..w).map(|x| matte.alpha.get_pixel(x, 45)[0]).collect();
    let crossing = row.iter().position(|&a| a >= 128).unwrap() as i64;
    assert!((crossing - 30).abs() <= 1, "alpha row {row:?}");
}

/// A replica serving from a recycling heap writes its alpha and trimap into blocks that
/// hold an earlier request's bytes, and fits the guided filter in buffers kept from the
/// image before: each image must still get exactly the matte a fresh replica gives it.
#[test]
fn a_replica_reusing_its_planes_and_buffers_gives_each_image_its_own_matte() {
    // Planes of 4.3 MB: large enough for the heap to keep (`RECYCLE_FROM`).
    let (w, h) = (2400u32, 1800u32);
    let square = |x0: u32, y0: u32, side: u32| {
        RgbImage::from_fn(w, h, move |x, y| {
            if (x0..x0 + side).contains(&x) && (y0..y0 + side).contains(&y) {
                Rgb([250, 250, 250])
            } else {
                Rgb([5, 5, 5])
            }
        })
    };
    let images = [
        square(300, 200, 900),
        RgbImage::from_fn(120, 90, |x, _| Rgb([(x * 2) as u8; 3])),
        square(1200, 700, 600),
        square(300, 200, 900),
    ];
    let heap = Arc::new(RecyclingHeap::default());
    let mut reusing = load("onnx/fixtures/prob-guided").with_pixels(heap.clone());
    let mut fresh = load("onnx/fixtures/prob-guided");
    for (i, image) in images.iter().enumerate() {
        let got = reusing.run(image, &mut StageTimings::default()).unwrap();
        let want = fresh.run(image, &mut StageTimings::default()).unwrap();
        let differ = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(a, b)| a != b).count();
        assert_eq!(differ(&got.alpha, &want.alpha), 0, "image {i}: alpha");
        assert_eq!(differ(&got.trimap, &want.trimap), 0, "image {i}: trimap");
        assert_eq!(got.alpha.dimensions(), image.dimensions());
    }
    // The last two large images' planes were the first ones' blocks, lent again.
    let stats = heap.stats();
    assert_eq!((stats.made, stats.reused), (2, 4), "{stats:?}");
}

#[test]
fn class_count_mismatch_is_an_error_not_a_panic() {
    let dir = repo("onnx/fixtures/classes-matting");
    let text = std::fs::read_to_string(dir.join("celer.toml"))
        .unwrap()
        .replace("class_values = [0, 128, 255]", "class_values = [0, 255]");
    let spec = PipelineSpec::parse(&text, &dir.join("celer.toml")).unwrap();
    let mut pipeline = CpuStages::load(&spec, 1).unwrap();
    let image = RgbImage::from_pixel(16, 16, Rgb([1, 2, 3]));
    let err = pipeline
        .run(&image, &mut StageTimings::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 classes"), "{err}");
}

#[test]
fn a_model_without_the_named_input_is_refused_at_load() {
    let dir = repo("onnx/fixtures/prob-guided");
    let text = std::fs::read_to_string(dir.join("celer.toml"))
        .unwrap()
        .replace("input = \"image\"", "input = \"pixels\"");
    let spec = PipelineSpec::parse(&text, &dir.join("celer.toml")).unwrap();
    let err = CpuStages::load(&spec, 1)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("no input named `pixels`") && err.contains("`image`"),
        "{err}"
    );
}

/// A lone run borrows the device's solo sessions (a thread per core); a run with a
/// request waiting, or beside another running replica, keeps to its own. Both give the
/// same alpha, for the segmentation model alone and for the two-model graph.
#[test]
fn solo_sessions_serve_a_lone_run_with_the_same_alpha() {
    for (dir, image) in [
        (
            "onnx/u2netp",
            decode(
                &std::fs::read(require(&repo("tests/data/fetched/chelsea.png"))).unwrap(),
                &DecodeLimits::default(),
            )
            .unwrap(),
        ),
        (
            "onnx/fixtures/classes-matting",
            RgbImage::from_fn(96, 40, |x, _| Rgb([(x * 2 + 20) as u8; 3])),
        ),
    ] {
        let spec = PipelineSpec::load_dir(&repo(dir)).expect("pipeline description");
        let cores = Arc::new(cpu_cores(&spec, 1, 2).expect("solo sessions load"));
        assert!(cores.has_solo(), "{dir}");
        let mut replica = CpuStages::on(&spec, 1, cores.clone()).expect("replica loads");
        let run = |replica: &mut CpuStages| {
            replica
                .run(&image, &mut StageTimings::default())
                .expect("pipeline runs")
        };

        let solo = run(&mut replica);
        assert_eq!(cores.solo_runs(), 1, "{dir}: a lone run goes solo");

        replica.note_waiting(1);
        let queued = run(&mut replica);
        assert_eq!(cores.solo_runs(), 1, "{dir}: a request waited");

        let other = cores.enter();
        let beside = run(&mut replica);
        assert_eq!(cores.solo_runs(), 1, "{dir}: another replica runs");
        drop(other);

        // The waiting count was for one run only.
        run(&mut replica);
        assert_eq!(cores.solo_runs(), 2, "{dir}");

        for (what, matte) in [("waiting", &queued), ("beside", &beside)] {
            assert_eq!(matte.alpha, solo.alpha, "{dir}: {what}: alpha");
            assert_eq!(matte.trimap, solo.trimap, "{dir}: {what}: trimap");
        }
    }
}

/// No solo set when the replicas' own sessions already have every thread asked for.
#[test]
fn no_solo_sessions_when_they_would_not_add_threads() {
    let spec = PipelineSpec::load_dir(&repo("onnx/u2netp")).expect("pipeline description");
    for (own, solo) in [(2, 2), (2, 1), (1, 0)] {
        let cores = cpu_cores(&spec, own, solo).expect("loads");
        assert!(!cores.has_solo(), "own {own}, solo {solo}");
    }
}
