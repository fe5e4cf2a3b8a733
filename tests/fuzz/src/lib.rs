//! The fuzz targets' bodies (`targets.rs`), shared with the stable corpus replay in
//! celer's own tests (tests/fuzz_corpus.rs).

pub mod targets;
