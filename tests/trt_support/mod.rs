//! TensorRT for the tests: the real libraries where the GPU tests run on a real GPU, and
//! otherwise celer's stand-in TensorRT (tests/tensorrt_standin: `libnvinfer.so.10` and
//! `libnvonnxparser.so.10`, running engines with ONNX Runtime on the stand-in CUDA
//! driver). celer loads either the same way: by soname (LD_LIBRARY_PATH) or by the paths
//! in CELER_NVINFER_PATH / CELER_NVONNXPARSER_PATH. A test that cannot get TensorRT fails.
//!
//! `CELER_TEST_TENSORRT=real` requires the real libraries, `standin` the stand-in; unset,
//! the stand-in goes with the stand-in CUDA driver and the real TensorRT with a real one.
#![allow(dead_code)]

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use celer::tensorrt::{LibraryPaths, TensorRt};

use super::gpu_support;

/// Which TensorRT this test process runs.
pub enum Kind {
    Real,
    /// The stand-in, in this folder (`libnvinfer.so.<major>`, `libnvonnxparser.so.<major>`).
    StandIn(PathBuf),
}

/// The TensorRT of this process, chosen on first use (after the CUDA driver).
pub fn kind() -> &'static Kind {
    static KIND: OnceLock<Kind> = OnceLock::new();
    KIND.get_or_init(|| {
        let on_standin_cuda = gpu_support::driver().standin().is_some();
        let wanted = std::env::var("CELER_TEST_TENSORRT").unwrap_or_default();
        let kind = match (wanted.as_str(), on_standin_cuda) {
            ("real", true) => panic!(
                "CELER_TEST_TENSORRT=real, but the tests run on the stand-in CUDA driver, which \
                 real TensorRT cannot use"
            ),
            ("standin", false) => panic!(
                "CELER_TEST_TENSORRT=standin, but the tests run on a real CUDA driver: the \
                 TensorRT stand-in runs only on the stand-in driver (CELER_TEST_CUDA=standin)"
            ),
            (_, false) => Kind::Real,
            (_, true) => Kind::StandIn(standin_dir()),
        };
        let which = match &kind {
            Kind::Real => "the real TensorRT".to_string(),
            Kind::StandIn(dir) => format!("celer's stand-in TensorRT ({})", dir.display()),
        };
        let _ = writeln!(std::io::stderr(), "TensorRT tests run on {which}");
        kind
    })
}

pub fn is_standin() -> bool {
    matches!(kind(), Kind::StandIn(_))
}

/// The major version of the headers celer was compiled against.
fn major() -> u32 {
    TensorRt::compiled_version()
        .expect("these tests need celer built with the `tensorrt` feature")
        .major
}

/// A folder holding the stand-in under TensorRT's sonames, linked to the cdylibs cargo
/// built next to this test binary (they are dev-dependencies of celer).
pub fn standin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let deps = exe.parent().expect("the test binary's folder");
        let dir = deps
            .parent()
            .expect("the profile's folder")
            .join("tensorrt-standin");
        std::fs::create_dir_all(&dir).expect("the stand-in's folder");
        let major = major();
        for (built, soname) in [
            ("libceler_trt_standin.so", format!("libnvinfer.so.{major}")),
            (
                "libceler_trt_standin_parser.so",
                format!("libnvonnxparser.so.{major}"),
            ),
        ] {
            let target = deps.join(built);
            assert!(
                target.is_file(),
                "the stand-in TensorRT library {} was not built: build the tests with \
                 --features tensorrt and TENSORRT_INCLUDE_DIR set (`make test` does)",
                target.display()
            );
            // A fresh link each time, put in place by rename, so that concurrent test
            // processes never see it missing.
            let link = dir.join(&soname);
            let fresh = dir.join(format!("{soname}.{}", std::process::id()));
            let _ = std::fs::remove_file(&fresh);
            std::os::unix::fs::symlink(&target, &fresh).expect("a link to the stand-in");
            std::fs::rename(&fresh, &link).expect("the stand-in's link in place");
        }
        dir
    })
    .clone()
}

/// Where this process loads TensorRT from.
pub fn library_paths() -> LibraryPaths {
    match kind() {
        Kind::Real => LibraryPaths::from_env(),
        Kind::StandIn(dir) => LibraryPaths {
            nvinfer: dir.join(format!("libnvinfer.so.{}", major())),
            nvonnxparser: dir.join(format!("libnvonnxparser.so.{}", major())),
        },
    }
}

/// TensorRT with its ONNX parser; the test fails when it cannot be loaded.
pub fn builder() -> TensorRt {
    TensorRt::load(&library_paths(), true)
        .unwrap_or_else(|e| panic!("TensorRT (with its ONNX parser) does not load: {e}"))
}

/// Makes a child process (`celer serve`, `celer build`) find the same TensorRT, by soname
/// as a user's would (after the CUDA driver: see `gpu_support::use_driver`).
pub fn use_tensorrt(command: &mut Command) -> &mut Command {
    gpu_support::use_driver(command);
    if let Kind::StandIn(dir) = kind() {
        let mut path = OsString::from(dir.as_os_str());
        let inherited = command
            .get_envs()
            .find(|(k, _)| *k == "LD_LIBRARY_PATH")
            .and_then(|(_, v)| v.map(|v| v.to_os_string()))
            .or_else(|| std::env::var_os("LD_LIBRARY_PATH"));
        if let Some(old) = inherited.filter(|o| !o.is_empty()) {
            path.push(":");
            path.push(old);
        }
        command.env("LD_LIBRARY_PATH", path);
    }
    command
}

/// The repository file `path`.
pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}
