//! Response sizes: the cut-out of each test photo (U2NetP, the default pipeline) as PNG,
//! as lossless WebP, and the alpha alone, against the PNG of the cut-out that kept the
//! colour under fully transparent pixels (celer before it zeroed it), with the encode
//! times. Prints a Markdown table and writes it to bench-results/formats.md.
//! `make bench-formats` (or `ORT_DYLIB_PATH=$(scripts/ort-path) cargo bench --bench
//! formats`); inputs come from `make models`.

use std::path::Path;
use std::time::{Duration, Instant};

use celer::codec::decode::{decode, DecodeLimits};
use celer::codec::encode;
use celer::matte::StageTimings;
use celer::replica::cpu::CpuStages;
use celer::spec::PipelineSpec;
use celer::stages::composite;
use image::{ExtendedColorType, RgbaImage};

const PHOTOS: [&str; 5] = [
    "astronaut.png",
    "chelsea.png",
    "photo-320x320.jpg",
    "photo-1920x1080.jpg",
    "photo-4032x3024.jpg",
];

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The median of five runs of `f`, and its result.
fn timed<T>(mut f: impl FnMut() -> T) -> (T, Duration) {
    let mut times = Vec::new();
    let mut out = None;
    for _ in 0..5 {
        let t = Instant::now();
        let r = f();
        times.push(t.elapsed());
        out = Some(r);
    }
    times.sort();
    (out.expect("ran"), times[times.len() / 2])
}

fn mb(bytes: usize) -> String {
    format!("{:.2}", bytes as f64 / 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e3)
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let spec = PipelineSpec::load_dir(&repo("onnx/u2netp")).expect("onnx/u2netp/celer.toml");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut pipeline = CpuStages::load(&spec, threads)
        .unwrap_or_else(|e| panic!("loading U2NetP: {e}; run `make models`"));
    let mut table = String::from(
        "| photo | size | source bytes | cut-out PNG, colour kept under alpha 0 (MB) | cut-out PNG (MB) | cut-out WebP lossless (MB) | WebP / PNG | alpha PNG (MB) | PNG encode ms (median of 5) | WebP encode ms (median of 5) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for name in PHOTOS {
        let path = repo("tests/data/fetched").join(name);
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run `make models`", path.display()));
        let image = decode(&bytes, &DecodeLimits::default()).expect("decodes");
        let (w, h) = image.dimensions();
        let mut timings = StageTimings::default();
        let matte = pipeline
            .run(&image, &mut timings)
            .expect("the pipeline runs");
        let cutout = composite::cutout(&image, &matte.alpha);
        // What celer sent before: the source colour under every pixel.
        let kept = RgbaImage::from_fn(w, h, |x, y| {
            let p = image.get_pixel(x, y);
            image::Rgba([p[0], p[1], p[2], matte.alpha.get_pixel(x, y)[0]])
        });
        let rgba = ExtendedColorType::Rgba8;
        let old_png = encode::png(kept.as_raw(), w, h, rgba).expect("png");
        let (png, png_time) = timed(|| encode::png(cutout.as_raw(), w, h, rgba).expect("png"));
        let (webp, webp_time) = timed(|| encode::webp(cutout.as_raw(), w, h, rgba).expect("webp"));
        let alpha = encode::png(matte.alpha.as_raw(), w, h, ExtendedColorType::L8).expect("png");
        // The WebP decodes to the same pixels.
        let back = image::load_from_memory(&webp)
            .expect("decodes")
            .into_rgba8();
        assert!(
            back.as_raw() == cutout.as_raw(),
            "{name}: WebP is not lossless"
        );
        let transparent = matte.alpha.as_raw().iter().filter(|&&a| a == 0).count();
        eprintln!(
            "{name}: {w}x{h}, {:.0} % transparent",
            100.0 * transparent as f64 / (w as f64 * h as f64)
        );
        table.push_str(&format!(
            "| {name} | {w}x{h} | {} | {} | {} | {} | {:.2} | {} | {} | {} |\n",
            bytes.len(),
            mb(old_png.len()),
            mb(png.len()),
            mb(webp.len()),
            webp.len() as f64 / png.len() as f64,
            mb(alpha.len()),
            ms(png_time),
            ms(webp_time),
        ));
    }
    println!("{table}");
    let out = repo("bench-results");
    if std::fs::create_dir_all(&out).is_ok() {
        let _ = std::fs::write(out.join("formats.md"), &table);
    }
}
