//! Links the stand-in libnvonnxparser against `libnvinfer.so.<major>` by soname, as the
//! real parser is linked, so that the dynamic loader resolves it to the libnvinfer already
//! opened (celer's shim checks that the two are one TensorRT). The link needs a library of
//! that soname now; the stand-in libnvinfer is built alongside, not before, so a stub with
//! the same soname and the two symbols used stands in for it at link time only.
//!
//! Without TENSORRT_INCLUDE_DIR (a build without celer's `tensorrt` feature) nothing is
//! linked and the crate is empty.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(celer_trt_standin)");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TENSORRT_INCLUDE_DIR");
    let Some(include) = std::env::var_os("TENSORRT_INCLUDE_DIR").map(PathBuf::from) else {
        return;
    };
    if let Err(e) = build(&include) {
        eprintln!("error: building the stand-in ONNX parser: {e}");
        std::process::exit(1);
    }
}

fn build(include: &std::path::Path) -> Result<(), String> {
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let header = include.join("NvInferVersion.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text =
        std::fs::read_to_string(&header).map_err(|e| format!("{}: {e}", header.display()))?;
    // NV_TENSORRT_MAJOR is either a number or the enterprise macro holding it.
    let define = |name: &str| -> Option<String> {
        text.lines().find_map(|l| {
            let rest = l.trim().strip_prefix("#define ")?.strip_prefix(name)?;
            rest.split_whitespace().next().map(str::to_string)
        })
    };
    let mut major = define("NV_TENSORRT_MAJOR").ok_or("no NV_TENSORRT_MAJOR")?;
    if major.parse::<u32>().is_err() {
        major = define(&major).ok_or_else(|| format!("NV_TENSORRT_MAJOR is {major}"))?;
    }
    let soname = format!("libnvinfer.so.{major}");
    let stub_dir = out.join("link-stub");
    std::fs::create_dir_all(&stub_dir).map_err(|e| e.to_string())?;
    let stub_c = stub_dir.join("stub.c");
    std::fs::write(
        &stub_c,
        "int celer_trt_standin_onnx_parser_version(void) { return 0; }\n\
         void* celer_trt_standin_create_onnx_parser(void* n, void* l, int v) { (void) n; (void) l; (void) v; return 0; }\n\
         int getInferLibVersion(void) { return 0; }\n",
    )
    .map_err(|e| e.to_string())?;
    let stub = stub_dir.join(&soname);
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&stub)
        .arg(&stub_c)
        .arg(format!("-Wl,-soname,{soname}"))
        .status()
        .map_err(|e| format!("running {cc}: {e}"))?;
    if !status.success() {
        return Err(format!("linking the link-time stub {}", stub.display()));
    }
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvonnxparser.so.{major}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-cdylib-link-arg={}", stub.display());
    println!("cargo:rustc-cfg=celer_trt_standin");
    Ok(())
}
