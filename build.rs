//! Build script. The default build does nothing here: no C++ is compiled and nothing
//! about TensorRT is needed. With `--features tensorrt` it compiles the shim in
//! src/tensorrt/shim against the headers in TENSORRT_INCLUDE_DIR (and CUDA_INCLUDE_DIR,
//! or a two-type stand-in for cuda_runtime_api.h) and generates its Rust bindings with
//! bindgen. The shim opens TensorRT at run time, so nothing is linked but libstdc++.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/tensorrt/shim");
    #[cfg(feature = "tensorrt")]
    if let Err(e) = tensorrt::build() {
        // Not a panic: a plain message reads better than a backtrace in cargo's output.
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "tensorrt")]
mod tensorrt {
    use std::path::{Path, PathBuf};

    const SHIM: &str = "src/tensorrt/shim";

    pub fn build() -> Result<(), String> {
        for var in ["TENSORRT_INCLUDE_DIR", "CUDA_INCLUDE_DIR"] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        let trt_include = std::env::var_os("TENSORRT_INCLUDE_DIR")
            .map(PathBuf::from)
            .ok_or(
                "the `tensorrt` feature compiles against TensorRT's headers: set TENSORRT_INCLUDE_DIR \
                 to the directory holding NvInfer.h and NvOnnxParser.h (TensorRT 10.x or 11.x, e.g. \
                 /usr/include/x86_64-linux-gnu or <tensorrt>/include)",
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

        let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
        bindgen::Builder::default()
            .header(Path::new(SHIM).join("celer_trt.h").to_string_lossy())
            .allowlist_function("celer_trt_.*")
            .allowlist_type("celer_trt_.*")
            .allowlist_var("CELER_TRT_.*")
            // Enum constants as plain integers: the shim returns them in int32_t fields,
            // and a Rust enum given an unknown value would be undefined behaviour.
            .default_enum_style(bindgen::EnumVariation::Consts)
            .prepend_enum_name(false)
            .layout_tests(true)
            .generate()
            .map_err(|e| format!("bindgen on {SHIM}/celer_trt.h failed: {e}"))?
            .write_to_file(out.join("celer_trt_sys.rs"))
            .map_err(|e| format!("cannot write the bindings: {e}"))?;
        Ok(())
    }
}
