//! The TensorRT loader against fake libraries (tests/fake_tensorrt/fake_tensorrt.c,
//! compiled here with the system C compiler): what a user sees when TensorRT is
//! missing, of the wrong version, or incomplete. Needs `--features tensorrt` (so the
//! TensorRT headers); `scripts/check-tensorrt` runs it against each header set. No GPU
//! and no real TensorRT are involved.

#![cfg(feature = "tensorrt")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use celer::tensorrt::{CudaContextScope, LibraryPaths, TensorRt, TrtError, TrtVersion};

/// No CUDA context: the fake libraries need none (a runtime's scope runs its calls as is).
struct NoCuda;

impl CudaContextScope for NoCuda {
    fn with_current(&self, f: &mut dyn FnMut()) -> Result<(), String> {
        f();
        Ok(())
    }
}

fn compiled() -> TrtVersion {
    TensorRt::compiled_version().expect("built with the tensorrt feature")
}

fn encode(v: TrtVersion) -> i64 {
    i64::from(v.major) * 10_000 + i64::from(v.minor) * 100 + i64::from(v.patch)
}

/// A folder for the fake libraries, emptied when the process first asks for it and kept
/// afterwards: the shim opens libraries with RTLD_NODELETE, so they stay mapped.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-tensorrt");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch folder");
        dir
    })
}

/// Compiles the fake into `scratch()/name` with `defines` and extra linker arguments.
fn fake(name: &str, defines: &[String], link: &[String]) -> PathBuf {
    let out = scratch().join(name);
    std::fs::create_dir_all(out.parent().expect("folder")).expect("folder");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_tensorrt/fake_tensorrt.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&source)
        .args(defines)
        .args(link)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(status.success(), "compiling the fake {name} failed");
    out
}

fn fake_nvinfer(name: &str, version: i64, extra: &[&str]) -> PathBuf {
    let mut defines = vec![
        "-DFAKE_NVINFER".to_string(),
        format!("-DFAKE_VERSION={version}"),
    ];
    defines.extend(extra.iter().map(|s| s.to_string()));
    fake(name, &defines, &[])
}

/// The one fake libnvinfer with the real soname (`libnvinfer.so.<major>`), shared by
/// every test: the dynamic loader resolves a parser's DT_NEEDED by soname to the first
/// library loaded with it, so there must be only one.
fn good_nvinfer() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let soname = format!("libnvinfer.so.{}", compiled().major);
        fake(
            &format!("good/{soname}"),
            &[
                "-DFAKE_NVINFER".into(),
                format!("-DFAKE_VERSION={}", encode(compiled())),
            ],
            &[format!("-Wl,-soname,{soname}")],
        )
    })
}

fn fake_parser(name: &str, version: i64, nvinfer: &Path) -> PathBuf {
    let dir = nvinfer.parent().expect("folder");
    fake(
        name,
        &[
            "-DFAKE_NVONNXPARSER".into(),
            format!("-DFAKE_VERSION={version}"),
        ],
        // --no-as-needed: the fake calls nothing in libnvinfer, but the real parser does,
        // and the shim checks which libnvinfer the parser is linked with.
        &[
            "-Wl,--no-as-needed".into(),
            nvinfer.display().to_string(),
            format!("-Wl,-rpath,{}", dir.display()),
        ],
    )
}

fn load(nvinfer: &Path) -> Result<TensorRt, TrtError> {
    TensorRt::load(
        &LibraryPaths {
            nvinfer: nvinfer.to_path_buf(),
            nvonnxparser: PathBuf::from("unused"),
        },
        false,
    )
}

fn load_with_parser(nvinfer: &Path, parser: &Path) -> Result<TensorRt, TrtError> {
    TensorRt::load(
        &LibraryPaths {
            nvinfer: nvinfer.to_path_buf(),
            nvonnxparser: parser.to_path_buf(),
        },
        true,
    )
}

/// The refusal's message (also printed: `scripts/check-tensorrt` shows them).
fn library_message(result: Result<TensorRt, TrtError>) -> String {
    match result {
        Err(TrtError::Library(message)) => {
            eprintln!("refused: {message}");
            message
        }
        Err(other) => panic!("expected TrtError::Library, got {other:?}"),
        Ok(trt) => panic!("expected a refusal, loaded {trt:?}"),
    }
}

#[test]
fn missing_library_is_reported_with_what_to_do() {
    let path = scratch().join("nowhere/libnvinfer.so.99");
    match load(&path) {
        Err(TrtError::LibraryNotFound(message)) => {
            eprintln!("not found: {message}");
            assert!(message.contains(&path.display().to_string()), "{message}");
            assert!(message.contains("No such file"), "{message}");
            assert!(message.contains("CELER_NVINFER_PATH"), "{message}");
            assert!(
                message.contains(&format!("TensorRT {}.x", compiled().major)),
                "{message}"
            );
        }
        other => panic!("expected LibraryNotFound, got {other:?}"),
    }
}

#[test]
fn default_paths_are_the_sonames_of_the_compiled_major() {
    let major = compiled().major;
    let defaults = LibraryPaths::with_env(|_| None);
    assert_eq!(
        defaults.nvinfer,
        PathBuf::from(format!("libnvinfer.so.{major}"))
    );
    assert_eq!(
        defaults.nvonnxparser,
        PathBuf::from(format!("libnvonnxparser.so.{major}"))
    );
    let overridden = LibraryPaths::with_env(|key| match key {
        "CELER_NVINFER_PATH" => Some("/opt/trt/lib/libnvinfer.so.10.16.0".into()),
        _ => Some("".into()),
    });
    assert_eq!(
        overridden.nvinfer,
        PathBuf::from("/opt/trt/lib/libnvinfer.so.10.16.0")
    );
    assert_eq!(
        overridden.nvonnxparser,
        PathBuf::from(format!("libnvonnxparser.so.{major}")),
        "an empty variable is unset"
    );
}

#[test]
fn other_major_version_is_refused_naming_both_versions() {
    let c = compiled();
    let other = TrtVersion {
        major: if c.major == 10 { 11 } else { 10 },
        minor: 3,
        patch: 0,
    };
    let path = fake_nvinfer("other-major.so", encode(other), &[]);
    let message = library_message(load(&path));
    assert!(
        message.contains(&format!("is TensorRT {other}")),
        "{message}"
    );
    assert!(
        message.contains(&format!("TensorRT {c} headers")),
        "{message}"
    );
    assert!(message.contains(&path.display().to_string()), "{message}");
}

#[test]
fn older_minor_version_is_refused_naming_both_versions() {
    let c = compiled();
    let older = if c.minor > 0 {
        TrtVersion {
            minor: c.minor - 1,
            patch: 0,
            ..c
        }
    } else {
        TrtVersion {
            major: c.major - 1,
            minor: 99,
            patch: 0,
        }
    };
    let message = library_message(load(&fake_nvinfer("older.so", encode(older), &[])));
    assert!(
        message.contains(&format!("is TensorRT {older}")),
        "{message}"
    );
    assert!(
        message.contains(&format!("TensorRT {c} headers")),
        "{message}"
    );
    assert!(
        message.contains(&format!("{}.{} or a newer {}.x", c.major, c.minor, c.major)),
        "{message}"
    );
}

#[test]
fn tensorrt_8_is_named_in_its_own_encoding() {
    let message = library_message(load(&fake_nvinfer("trt8.so", 8601, &[])));
    assert!(message.contains("is TensorRT 8.6.1"), "{message}");
}

#[test]
fn newer_minor_loads_and_a_null_runtime_is_reported() {
    let c = compiled();
    let newer = TrtVersion {
        minor: c.minor + 1,
        ..c
    };
    let trt =
        load(&fake_nvinfer("newer.so", encode(newer), &[])).expect("a newer minor is accepted");
    assert_eq!(trt.version(), newer);
    assert!(
        trt.library_file().ends_with("newer.so"),
        "{}",
        trt.library_file().display()
    );
    match trt.runtime(std::sync::Arc::new(NoCuda)) {
        Err(TrtError::Call { call, message }) => {
            eprintln!("null runtime: {message}");
            assert_eq!(call, "createInferRuntime");
            assert!(message.contains("createInferRuntime_INTERNAL"), "{message}");
            assert!(message.contains("returned no runtime"), "{message}");
        }
        Err(other) => panic!("expected TrtError::Call, got {other:?}"),
        Ok(_) => panic!("the fake's factory returns null"),
    }
}

#[test]
fn missing_entry_point_is_named() {
    let path = fake_nvinfer(
        "no-runtime.so",
        encode(compiled()),
        &["-DFAKE_OMIT_RUNTIME"],
    );
    let message = library_message(load(&path));
    assert!(
        message.contains("has no entry point createInferRuntime_INTERNAL"),
        "{message}"
    );
}

#[test]
fn a_library_that_is_not_tensorrt_is_named() {
    let path = fake_nvinfer("not-trt.so", 0, &["-DFAKE_OMIT_VERSION"]);
    let message = library_message(load(&path));
    assert!(
        message.contains("has no entry point getInferLibVersion"),
        "{message}"
    );
}

#[test]
fn builder_needs_the_parser_and_reports_a_null_builder() {
    let nvinfer = good_nvinfer();
    // The runtime-only load has no parser.
    let runtime_only = load(nvinfer).expect("matching version loads");
    let onnx = Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/fixtures/prob.onnx");
    match runtime_only.parse_onnx(&onnx) {
        Err(TrtError::Library(message)) => assert!(message.contains("load_builder"), "{message}"),
        other => panic!("expected a missing-parser error, got {:?}", other.err()),
    }
    let parser = fake_parser("parser/libnvonnxparser.so", onnx_parser_version(), nvinfer);
    let trt = load_with_parser(nvinfer, &parser).expect("parser of the same installation loads");
    match trt.parse_onnx(&onnx) {
        Err(TrtError::Call { message, .. }) => {
            eprintln!("null builder: {message}");
            assert!(message.contains("createInferBuilder_INTERNAL"), "{message}");
            assert!(message.contains("returned no builder"), "{message}");
        }
        other => panic!("expected a null-builder error, got {:?}", other.err()),
    }
}

#[test]
fn parser_of_another_version_is_refused() {
    let wrong = onnx_parser_version() + 10_000;
    let parser = fake_parser("parser-version/libnvonnxparser.so", wrong, good_nvinfer());
    let message = library_message(load_with_parser(good_nvinfer(), &parser));
    assert!(message.contains("is ONNX parser"), "{message}");
    assert!(message.contains("headers"), "{message}");
}

#[test]
fn parser_linked_to_another_libnvinfer_is_refused() {
    let other = fake(
        "elsewhere/libnvinfer_other.so.1",
        &[
            "-DFAKE_NVINFER".into(),
            format!("-DFAKE_VERSION={}", encode(compiled())),
        ],
        &["-Wl,-soname,libnvinfer_other.so.1".into()],
    );
    let parser = fake_parser(
        "elsewhere/libnvonnxparser.so",
        onnx_parser_version(),
        &other,
    );
    let message = library_message(load_with_parser(good_nvinfer(), &parser));
    assert!(message.contains("libnvinfer_other.so.1"), "{message}");
    assert!(message.contains("not with the opened"), "{message}");
}

/// NV_ONNX_PARSER_VERSION of the compiled headers, encoded as the parser reports it.
fn onnx_parser_version() -> i64 {
    let v = TensorRt::compiled_parser_version().expect("built with the tensorrt feature");
    encode(v)
}
