//! The block cache on a real model: U2NetP sessions take their activations from it, a
//! run after the first maps no new block, replicas running side by side share it, the
//! outputs are the same bits as a session on plain malloc, and giving the cache back
//! empties it.
//!
//! One test in this binary: the cache and its counts are process-wide.

mod common;

use celer::ort::session::{OpThreads, OrtModel};
use celer::ort::{allocator, block_cache};
use celer::spec::PipelineSpec;

#[test]
fn sessions_reuse_the_cached_blocks_and_give_the_same_bits() {
    let spec = PipelineSpec::load_dir(&common::model_dir("u2netp")).expect("u2netp");
    let model = &spec.segmentation.image.model;
    let output = spec.segmentation.output.as_str();
    let input_name = spec.segmentation.image.input.as_str();
    let (h, w) = (
        spec.segmentation.image.height as usize,
        spec.segmentation.image.width as usize,
    );
    // A deterministic, image-like input: smooth gradients plus a bright square.
    let input: Vec<f32> = (0..3 * h * w)
        .map(|i| {
            let (c, y, x) = (i / (h * w), (i / w) % h, i % w);
            let square = (100..220).contains(&y) && (90..230).contains(&x);
            (x + y + 40 * c) as f32 / 700.0 + if square { 1.5 } else { -0.5 }
        })
        .collect();
    let inputs = [(input_name, [1, 3, h, w], input.as_slice())];

    // The same threads as the cached session, so the kernels split the work alike.
    let mut plain = OrtModel::load_uncached(
        model,
        OpThreads::Own {
            threads: 2,
            alone: false,
        },
    )
    .expect("a session on malloc");
    let expected = plain.run(&inputs, output).expect("plain run");
    assert_eq!(
        allocator::stats().mapped,
        0,
        "an uncached session must not use the cache"
    );

    let mut alone = OrtModel::load(
        model,
        OpThreads::Own {
            threads: 2,
            alone: true,
        },
    )
    .expect("a session that runs alone");
    let mut mapped_after = Vec::new();
    for run in 0..4 {
        let got = alone.run(&inputs, output).expect("cached run");
        assert!(
            got == expected,
            "run {run}: the cached session's output differs from the plain session's"
        );
        mapped_after.push(allocator::stats());
    }
    let (first, last) = (mapped_after[0], mapped_after[3]);
    assert!(first.mapped > 0 && first.high_water > 0, "{first:?}");
    assert_eq!(
        mapped_after[2].mapped, last.mapped,
        "the fourth run mapped new blocks: {mapped_after:?}"
    );
    assert!(last.reused > first.reused, "{last:?}");
    // A finished run's activations are all back; the session keeps a few small buffers.
    assert!(
        last.in_use < 1 << 20,
        "a finished run's blocks are not back: {last:?}"
    );
    // Only lone runs so far: the two marks are one run's peak.
    assert!(last.lone_high_water > 0 && last.lone_high_water == last.high_water);
    assert!(last.cached > 0 && last.cached <= last.ceiling(), "{last:?}");
    assert!(last.ceiling() <= last.high_water * block_cache::MAX_CEILING);
    assert_eq!(last.runs, 0);

    // Two replicas of one thread each, side by side, as a busy device runs them: the
    // same bits as a plain session of one thread, from the same cache.
    let mut plain_one = OrtModel::load_uncached(model, 1).expect("a replica on malloc");
    let expected_one = plain_one.run(&inputs, output).expect("plain replica run");
    let mut replicas: Vec<OrtModel> = (0..2)
        .map(|_| OrtModel::load(model, 1).expect("a replica"))
        .collect();
    std::thread::scope(|scope| {
        for (i, replica) in replicas.iter_mut().enumerate() {
            let (inputs, expected_one) = (&inputs, &expected_one);
            scope.spawn(move || {
                for run in 0..3 {
                    let got = replica.run(inputs, output).expect("replica run");
                    assert!(
                        got == *expected_one,
                        "replica {i}, run {run}: output differs"
                    );
                }
            });
        }
    });
    let side_by_side = allocator::stats();
    assert!(side_by_side.reused > last.reused, "{side_by_side:?}");
    assert!(side_by_side.high_water >= side_by_side.lone_high_water);
    assert!(
        side_by_side.in_use + side_by_side.cached <= side_by_side.ceiling(),
        "{side_by_side:?}"
    );
    assert_eq!(side_by_side.runs, 0);

    allocator::release_cached();
    let released = allocator::stats();
    assert_eq!(released.cached, 0, "{released:?}");
    // Runs on after the cache was given back, mapping afresh, with the same output.
    let got = alone.run(&inputs, output).expect("run after release");
    assert!(got == expected);
    assert!(allocator::stats().mapped > released.mapped);
}
