//! The batched model run the batcher relies on: `Pipeline::run_batch` stacks the
//! segmentation inputs into one [N, 3, h, w] tensor and must give each image what `run`
//! gives it alone; `[batching]` is refused for a model whose batch dimension is fixed.

use std::path::{Path, PathBuf};

use celer::matte::StageTimings;
use celer::replica::cpu::CpuStages;
use celer::spec::{BatchingSpec, PipelineSpec};
use image::{Rgb, RgbImage};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn images() -> Vec<RgbImage> {
    // Different sizes and contents, so a mix-up between batch entries shows.
    (0..3u32)
        .map(|i| {
            let (w, h) = (40 + 24 * i, 56 - 8 * i);
            RgbImage::from_fn(w, h, |x, y| {
                let inside = x > w / (3 + i) && x < w - w / 4 && y > h / 4 && y < h - h / (3 + i);
                if inside {
                    Rgb([230, 200 + 10 * i as u8, 210])
                } else {
                    Rgb([15 + 20 * i as u8, 25, 30])
                }
            })
        })
        .collect()
}

fn batched_equals_alone(dir: &str) {
    let mut spec = PipelineSpec::load_dir(&repo(dir)).expect("fixture description");
    spec.batching = BatchingSpec {
        max_batch: 4,
        max_wait_us: 0,
    };
    let mut pipeline = CpuStages::load(&spec, 1).expect("fixture loads with batching");
    let images = images();
    let refs: Vec<&RgbImage> = images.iter().collect();
    let mut timings = vec![StageTimings::default(); refs.len()];
    let batched = pipeline
        .run_batch(&refs, &mut timings)
        .expect("batched run");
    assert_eq!(batched.len(), images.len());
    for (i, (image, matte)) in images.iter().zip(&batched).enumerate() {
        let alone = pipeline
            .run(image, &mut StageTimings::default())
            .expect("single run");
        assert_eq!(matte.alpha.dimensions(), image.dimensions(), "image {i}");
        assert_eq!(matte.trimap, alone.trimap, "{dir}: image {i} trimap");
        // The same arithmetic per image; allow one level for kernels that sum a batch
        // in a different order.
        let worst = matte
            .alpha
            .as_raw()
            .iter()
            .zip(alone.alpha.as_raw().iter())
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap_or(0);
        assert!(worst <= 1, "{dir}: image {i} alpha differs by {worst}");
        assert!(timings[i].model > std::time::Duration::ZERO);
    }
}

#[test]
fn a_batch_gives_each_image_what_it_gets_alone() {
    batched_equals_alone("onnx/fixtures/prob-guided");
    batched_equals_alone("onnx/fixtures/classes-matting");
}

#[test]
fn batching_is_refused_for_a_fixed_batch_dimension() {
    let model = repo("onnx/u2netp/u2netp.onnx");
    assert!(
        model.is_file(),
        "{} is missing: run `make models`",
        model.display()
    );
    let mut spec = PipelineSpec::load_dir(&repo("onnx/u2netp")).expect("description");
    spec.batching = BatchingSpec {
        max_batch: 2,
        max_wait_us: 1_000,
    };
    let error = match CpuStages::load(&spec, 1) {
        Ok(_) => panic!("U2NetP's batch is fixed at 1: batching must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains("dynamic batch"), "{error}");
    assert!(error.contains("max_batch = 2"), "{error}");
}
