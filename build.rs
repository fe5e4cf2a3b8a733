//! Build script. Every build generates the gRPC service's Rust code (messages and server)
//! from the project's .proto files in src/oip/proto, with prost and tonic, running
//! the protoc that protoc-bin-vendored carries (nothing installed is needed). No C++ is
//! compiled and nothing about TensorRT is needed by default. With `--features tensorrt` it compiles the shim in
//! src/tensorrt/shim against the headers in TENSORRT_INCLUDE_DIR (`make` fetches the
//! public TensorRT 10.16 ones: scripts/fetch-tensorrt-headers) and CUDA_INCLUDE_DIR, or a
//! two-type stand-in for cuda_runtime_api.h. The shim opens TensorRT at run time, so
//! nothing is linked but libstdc++.
//!
//! The shim's Rust bindings are committed (src/tensorrt/sys_bindings.rs, generated from
//! the project's own C header), so that a build needs no libclang: this script refuses
//! them when celer_trt.h has changed since, and the feature `tensorrt-bindgen` (what `make
//! tensorrt-bindings` runs) regenerates them with bindgen.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/tensorrt/shim");
    if let Err(e) = grpc() {
        eprintln!("error: generating the gRPC code: {e}");
        std::process::exit(1);
    }
    #[cfg(feature = "tensorrt")]
    if let Err(e) = tensorrt::build() {
        // Not a panic: a plain message reads better than a backtrace in cargo's output.
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// The Open Inference Protocol's service and gRPC's health service, server side only
/// (the tests call them with Triton's, KServe's and grpcio's own clients).
fn grpc() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "src/oip/proto";
    let protos = [
        format!("{PROTO}/grpc_service.proto"),
        format!("{PROTO}/health.proto"),
    ];
    for proto in &protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Raw tensor contents as `Bytes`: sliced out of the received message, not copied.
    config.bytes([
        ".inference.ModelInferRequest.raw_input_contents",
        ".inference.ModelInferResponse.raw_output_contents",
        ".inference.InferTensorContents.bytes_contents",
    ]);
    tonic_prost_build::configure()
        .build_client(false)
        .build_transport(false)
        .compile_with_config(config, &protos, &[PROTO.to_string()])?;
    Ok(())
}

#[cfg(feature = "tensorrt")]
mod tensorrt {
    use std::path::{Path, PathBuf};

    const SHIM: &str = "src/tensorrt/shim";
    const BINDINGS: &str = "src/tensorrt/sys_bindings.rs";

    pub fn build() -> Result<(), String> {
        for var in ["TENSORRT_INCLUDE_DIR", "CUDA_INCLUDE_DIR"] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        println!("cargo:rerun-if-changed={BINDINGS}");
        let trt_include = std::env::var_os("TENSORRT_INCLUDE_DIR")
            .map(PathBuf::from)
            .ok_or(
                "the `tensorrt` feature compiles against TensorRT's headers: set TENSORRT_INCLUDE_DIR \
                 to the directory holding NvInfer.h and NvOnnxParser.h (TensorRT 10.x or 11.x, e.g. \
                 /usr/include/x86_64-linux-gnu or <tensorrt>/include), or build with `make build`, \
                 which fetches the public TensorRT 10.16 headers (scripts/fetch-tensorrt-headers)",
            )?;
        for header in ["NvInfer.h", "NvOnnxParser.h", "NvInferVersion.h"] {
            if !trt_include.join(header).is_file() {
                return Err(format!(
                    "TENSORRT_INCLUDE_DIR={} has no {header}",
                    trt_include.display()
                ));
            }
        }
        println!(
            "cargo:rerun-if-changed={}",
            trt_include.join("NvInferVersion.h").display()
        );
        // The tests compile code of their own against the same headers (the stand-in
        // TensorRT's rule harness).
        println!(
            "cargo:rustc-env=CELER_TENSORRT_INCLUDE_DIR={}",
            trt_include.display()
        );
        // Real CUDA headers when given; otherwise the stand-in declaring the only two CUDA
        // types TensorRT's headers use (ABI-identical, see the stub's comment).
        let cuda_include = match std::env::var_os("CUDA_INCLUDE_DIR").map(PathBuf::from) {
            Some(dir) if dir.join("cuda_runtime_api.h").is_file() => dir,
            Some(dir) => {
                return Err(format!(
                    "CUDA_INCLUDE_DIR={} has no cuda_runtime_api.h",
                    dir.display()
                ))
            }
            None => Path::new(SHIM).join("cuda-stub"),
        };

        cc::Build::new()
            .cpp(true)
            .std("c++17")
            .file(Path::new(SHIM).join("celer_trt.cpp"))
            .include(SHIM)
            // -isystem: TensorRT's headers have their own warnings (deprecations, unused
            // parameters); the shim's stay visible.
            .flag("-isystem")
            .flag(cuda_include.to_string_lossy().as_ref())
            .flag("-isystem")
            .flag(trt_include.to_string_lossy().as_ref())
            .flag("-fvisibility=hidden")
            .warnings(true)
            .extra_warnings(true)
            .compile("celer_trt");
        // dlopen/dlsym live in libc from glibc 2.34; libdl keeps older systems linking.
        println!("cargo:rustc-link-lib=dylib=dl");
        bindings()
    }

    /// The first line of the committed bindings: which version of celer_trt.h (by its
    /// FNV-1a hash: a change detector, not a seal) they were generated from.
    fn header_line(header: &Path) -> Result<String, String> {
        let bytes =
            std::fs::read(header).map_err(|e| format!("cannot read {}: {e}", header.display()))?;
        let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        Ok(format!(
            "// Generated by bindgen from {} (fnv1a64 {hash:016x}): `make tensorrt-bindings`",
            header.display()
        ))
    }

    /// Checks the committed bindings against celer_trt.h.
    #[cfg(not(feature = "tensorrt-bindgen"))]
    fn bindings() -> Result<(), String> {
        let header = Path::new(SHIM).join("celer_trt.h");
        let committed = std::fs::read_to_string(BINDINGS)
            .map_err(|e| format!("cannot read {BINDINGS}: {e}"))?;
        if committed.lines().next() != Some(header_line(&header)?.as_str()) {
            return Err(format!(
                "{} changed since {BINDINGS} was generated from it: run `make tensorrt-bindings` \
                 (bindgen; needs libclang) and commit the result",
                header.display()
            ));
        }
        Ok(())
    }

    /// Writes the bindings of celer_trt.h anew (`make tensorrt-bindings`).
    #[cfg(feature = "tensorrt-bindgen")]
    fn bindings() -> Result<(), String> {
        let header = Path::new(SHIM).join("celer_trt.h");
        let generated = bindgen::Builder::default()
            .header(header.to_string_lossy())
            .allowlist_function("celer_trt_.*")
            .allowlist_type("celer_trt_.*")
            .allowlist_var("CELER_TRT_.*")
            // Enum constants as plain integers: the shim returns them in int32_t fields,
            // and a Rust enum given an unknown value would be undefined behaviour.
            .default_enum_style(bindgen::EnumVariation::Consts)
            .prepend_enum_name(false)
            .layout_tests(true)
            .generate()
            .map_err(|e| format!("bindgen on {}: {e}", header.display()))?
            .to_string();
        let text = format!(
            "{}\n// regenerates it (needs libclang); build.rs refuses a header that no longer matches.\n{generated}",
            header_line(&header)?
        );
        std::fs::write(BINDINGS, text).map_err(|e| format!("cannot write {BINDINGS}: {e}"))
    }
}
