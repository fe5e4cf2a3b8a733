//! Each CPU stage on a 1920x1080 and a 4032x3024 photo: decode, resize + normalise,
//! trimap (threshold + erosion + resize to source), guided filter, composite, encode.
//! `cargo bench --bench stages`; inputs come from `make models` (tests/data/fetched).

use std::path::Path;

use celer::codec::decode::{decode, DecodeLimits};
use celer::codec::encode;
use celer::spec::{Normalize, Scale};
use celer::stages::lanes::Lanes;
use celer::stages::plane::Plane;
use celer::stages::{composite, guided_filter, preprocess, resample, trimap};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use fast_image_resize::Resizer;
use image::ExtendedColorType;

const PHOTOS: [&str; 2] = ["photo-1920x1080.jpg", "photo-4032x3024.jpg"];

fn photo(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/fetched")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}; run `make models`", path.display()))
}

/// A plausible coarse mask: a disc, soft at its rim, at the model's 320x320.
fn coarse_mask() -> Plane {
    let data = (0..320 * 320)
        .map(|k| {
            let (x, y) = ((k % 320) as f32 - 160.0, (k / 320) as f32 - 170.0);
            ((120.0 - (x * x + y * y).sqrt()) / 8.0 + 0.5).clamp(0.0, 1.0)
        })
        .collect();
    Plane::new(320, 320, data)
}

fn stages(c: &mut Criterion) {
    let u2netp = Normalize {
        scale: Scale::ImageMax,
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };
    for name in PHOTOS {
        let bytes = photo(name);
        let image = decode(&bytes, &DecodeLimits::default()).expect("decodes");
        let (w, h) = image.dimensions();
        let size = format!("{w}x{h}");
        let mut g = c.benchmark_group("stage");
        g.sample_size(10);
        g.bench_with_input(
            BenchmarkId::new("decode_jpeg", &size),
            &bytes,
            |b, bytes| b.iter(|| decode(bytes, &DecodeLimits::default()).unwrap()),
        );
        let (mut resized, mut input) = (Vec::new(), vec![0f32; 3 * 320 * 320]);
        g.bench_function(BenchmarkId::new("resize_normalise", &size), |b| {
            b.iter(|| {
                preprocess::resize_rgb(&image, 320, 320, &mut resized);
                preprocess::normalize_into(&resized, &u2netp, &mut input);
            })
        });
        let coarse = coarse_mask();
        g.bench_function(BenchmarkId::new("trimap", &size), |b| {
            b.iter(|| {
                let mut t = trimap::threshold(&coarse, 0.94, 0.04);
                trimap::erode(&mut t, 2);
                resample::resize_nearest(&t, w, h)
            })
        });
        let mut small = trimap::threshold(&coarse, 0.94, 0.04);
        trimap::erode(&mut small, 2);
        let full_trimap = resample::resize_nearest(&small, w, h);
        let mut resizer = Resizer::new();
        g.bench_function(BenchmarkId::new("guided_filter_s4", &size), |b| {
            b.iter(|| {
                guided_filter::fit(Lanes::ONE, &mut resizer, &image, &coarse, 8, 1e-3, 4)
                    .unwrap()
                    .alpha(Lanes::ONE, &image, &full_trimap)
            })
        });
        let alpha = guided_filter::fit(Lanes::ONE, &mut resizer, &image, &coarse, 8, 1e-3, 4)
            .unwrap()
            .alpha(Lanes::ONE, &image, &full_trimap);
        g.bench_function(BenchmarkId::new("composite", &size), |b| {
            b.iter(|| composite::cutout(&image, &alpha))
        });
        let rgba = composite::cutout(&image, &alpha);
        g.bench_function(BenchmarkId::new("encode_png_rgba", &size), |b| {
            b.iter(|| encode::png(rgba.as_raw(), w, h, ExtendedColorType::Rgba8).unwrap())
        });
        g.finish();
    }
}

criterion_group!(benches, stages);
criterion_main!(benches);
