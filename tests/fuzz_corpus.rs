//! The fuzz targets (tests/fuzz, cargo-fuzz on nightly: `make fuzz`) replayed on stable
//! over the committed corpus and every regression input (a crash the fuzzer found,
//! saved under tests/fuzz/regressions/TARGET), so that `make test` checks each target's
//! invariants on them without nightly or sanitizers.

#[path = "fuzz/src/targets.rs"]
mod targets;

use std::path::PathBuf;

/// Runs `target` on every file of the target's corpus and regressions; the number run.
fn replay(name: &str, target: fn(&[u8])) -> usize {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz");
    let mut ran = 0;
    for kind in ["corpus", "regressions"] {
        let dir = root.join(kind).join(name);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != ".gitkeep"))
            .collect();
        files.sort();
        for file in files {
            let data = std::fs::read(&file).expect("a corpus file");
            let outcome = std::panic::catch_unwind(|| target(&data));
            assert!(outcome.is_ok(), "{name}: {} failed", file.display());
            ran += 1;
        }
    }
    assert!(ran > 0, "no corpus for {name}");
    ran
}

#[test]
fn decode_corpus() {
    assert!(replay("decode", targets::decode) >= 10);
}

#[test]
fn request_corpus() {
    assert!(replay("request", targets::request) >= 10);
}

#[test]
fn celer_toml_corpus() {
    assert!(replay("celer_toml", targets::celer_toml) >= 3);
}

#[test]
fn manifest_corpus() {
    assert!(replay("manifest", targets::manifest) >= 2);
}

/// The request target holds real requests to account: a valid one is answered 200.
#[test]
fn the_request_target_serves_a_valid_request() {
    let png = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus/request/png-cutout"),
    )
    .unwrap();
    // It asserts on every answer; a valid PNG must not be refused either.
    targets::request(&png);
    assert!(png.len() > 100);
}
