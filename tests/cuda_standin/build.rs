//! Builds the stand-in CUDA driver, `libcuda.so.1`, into OUT_DIR/drivers/<version>/, once
//! per CUDA version it can be (the same code; what differs is the version it reports and
//! the entry points it exports): the driver (driver/), and every `.cu` file of celer (src/cuda/kernels) and of the stand-in's own tests
//! (kernels/) compiled as host C++ through driver/kernel.h. The kernels to register are
//! found in each file's preprocessed text (every `__global__` function, macro-made ones
//! included); their parameter types come from the compiler (registry.h), not from here.
//!
//! Only the tests depend on this crate, so a plain `cargo build` of celer compiles no C++.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    if let Err(e) = build() {
        eprintln!("error: building the stand-in CUDA driver: {e}");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    let here = PathBuf::from(env("CARGO_MANIFEST_DIR")?);
    let out = PathBuf::from(env("OUT_DIR")?);
    let celer_kernels = here.join("../../src/cuda/kernels");
    let driver_dir = here.join("driver");
    let test_kernels = here.join("kernels");
    for dir in [&celer_kernels, &driver_dir, &test_kernels] {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CXX");

    let mut sources: Vec<PathBuf> = Vec::new();
    for dir in [&celer_kernels, &test_kernels] {
        sources.extend(files_with_extension(dir, "cu")?);
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());

    // One registration file per .cu file.
    let mut units: Vec<(PathBuf, bool)> = [
        "driver.cpp",
        "arena.cpp",
        "lanes.cpp",
        "cubin.cpp",
        "codes.cpp",
        "registry.cpp",
    ]
    .iter()
    .map(|f| (driver_dir.join(f), false))
    .collect();
    for source in &sources {
        let kernels = kernels_of(&cxx, source, &celer_kernels)?;
        if kernels.is_empty() {
            continue;
        }
        let stem = source
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("kernels");
        // The source as compiled: each `__shared__` declaration followed by the call that
        // poisons the variable when a block starts (kernel.h: shared_reached).
        let text = std::fs::read_to_string(source)
            .map_err(|e| format!("reading {}: {e}", source.display()))?;
        let rewritten = out.join(format!("shared_{stem}.cu"));
        std::fs::write(&rewritten, poison_shared(source, &text)?)
            .map_err(|e| format!("writing {}: {e}", rewritten.display()))?;
        let unit = out.join(format!("kernels_{stem}.cpp"));
        std::fs::write(&unit, registration(source, &rewritten, &kernels)?)
            .map_err(|e| format!("writing {}: {e}", unit.display()))?;
        units.push((unit, true));
    }

    // Compile in parallel (a handful of files), then link.
    let flags = [
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-fvisibility=hidden",
        "-ffp-contract=off",
        "-fno-fast-math",
        "-U_FORTIFY_SOURCE",
        "-D_FORTIFY_SOURCE=0",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
    ];
    let mut children = Vec::new();
    let mut objects = Vec::new();
    for (unit, is_kernels) in &units {
        let object = out.join(format!(
            "{}.o",
            unit.file_stem().and_then(|s| s.to_str()).unwrap_or("unit")
        ));
        let mut command = Command::new(&cxx);
        command
            .args(flags)
            .arg("-I")
            .arg(&driver_dir)
            .arg("-I")
            .arg(&celer_kernels)
            .arg("-c")
            .arg(unit)
            .arg("-o")
            .arg(&object);
        if *is_kernels {
            // The rewritten sources live in OUT_DIR: their own includes come from here.
            command.arg("-I").arg(&test_kernels);
            // `#pragma unroll` and friends mean nothing to the host build.
            command.arg("-Wno-unknown-pragmas");
            command.arg("-include").arg(driver_dir.join("kernel.h"));
        }
        let child = command
            .spawn()
            .map_err(|e| format!("running {cxx} (needed to build the stand-in): {e}"))?;
        children.push((unit.clone(), child));
        objects.push(object);
    }
    let mut failed = Vec::new();
    for (unit, child) in children {
        let status = child.wait_with_output().map_err(|e| e.to_string())?.status;
        if !status.success() {
            failed.push(unit.display().to_string());
        }
    }
    if !failed.is_empty() {
        return Err(format!("{cxx} failed on {}", failed.join(", ")));
    }
    // One library per driver version, each with its version object and export map.
    let mut version_objects = Vec::new();
    for driver in &DRIVERS {
        let object = out.join(format!("version_{}.o", driver.code));
        let status = Command::new(&cxx)
            .args(flags)
            .arg(format!("-DCELER_STANDIN_CUDA_VERSION={}", driver.code))
            .arg("-I")
            .arg(&driver_dir)
            .arg("-c")
            .arg(driver_dir.join("version.cpp"))
            .arg("-o")
            .arg(&object)
            .status()
            .map_err(|e| format!("running {cxx}: {e}"))?;
        if !status.success() {
            return Err(format!(
                "{cxx} failed on version.cpp for CUDA {}",
                driver.name
            ));
        }
        version_objects.push(object);
    }
    let drivers = out.join("drivers");
    for (driver, version_object) in DRIVERS.iter().zip(&version_objects) {
        link(&cxx, &out, &drivers, driver, &objects, version_object)?;
    }
    println!(
        "cargo:rustc-env=CELER_CUDA_STANDIN_DRIVERS={}",
        drivers.display()
    );
    println!(
        "cargo:rustc-env=CELER_CUDA_STANDIN_VERSIONS={}",
        DRIVERS.map(|d| d.name).join(",")
    );
    Ok(())
}

/// A driver version the stand-in can be: its name, cuDriverGetVersion's value for it.
struct DriverVersion {
    name: &'static str,
    code: u32,
}

/// The versions built (OUT_DIR/drivers/<name>/libcuda.so.1): 11.8, below celer's floor
/// (its refusal is tested), the floor (12.2, R535), the versions SageMaker's and the
/// clouds' images move through, and 13.0, the default.
const DRIVERS: [DriverVersion; 5] = [
    DriverVersion {
        name: "11.8",
        code: 11080,
    },
    DriverVersion {
        name: "12.2",
        code: 12020,
    },
    DriverVersion {
        name: "12.4",
        code: 12040,
    },
    DriverVersion {
        name: "12.8",
        code: 12080,
    },
    DriverVersion {
        name: "13.0",
        code: 13000,
    },
];

/// The entry points the stand-in exports that are newer than CUDA 11.0, with the version
/// that introduced each (CUDA's driver API reference); every other one is in all drivers
/// from 11.0 on. A library for an older version does not export them, as that driver does
/// not: a lookup of it fails (celer's driver layer says which is missing), which is what
/// the floor tests rely on.
const INTRODUCED: [(&str, u32); 5] = [
    ("cuMemAllocAsync", 11020),
    ("cuMemFreeAsync", 11020),
    ("cuDeviceGetUuid_v2", 11040),
    ("cuCtxSetFlags", 12010),
    ("cuEventElapsedTime_v2", 12080),
];

/// Links `drivers/<name>/libcuda.so.1` (and the `libcuda.so` name cudarc tries first)
/// from the shared objects and the version's own, exporting only that version's entry
/// points and the stand-in's controls.
fn link(
    cxx: &str,
    out: &Path,
    drivers: &Path,
    driver: &DriverVersion,
    objects: &[PathBuf],
    version_object: &Path,
) -> Result<(), String> {
    let lib_dir = drivers.join(driver.name);
    std::fs::create_dir_all(&lib_dir).map_err(|e| e.to_string())?;
    let library = lib_dir.join("libcuda.so.1");
    // An exact name outranks a wildcard in a version script: `local: cuX;` hides cuX from
    // the `cu*` export.
    let lacking: String = INTRODUCED
        .iter()
        .filter(|(_, since)| *since > driver.code)
        .map(|(name, _)| format!(" {name};"))
        .collect();
    let exports = out.join(format!("exports-{}.map", driver.name));
    std::fs::write(
        &exports,
        format!("{{ global: cu*; celer_standin_*; local:{lacking} *; }};\n"),
    )
    .map_err(|e| e.to_string())?;
    let status = Command::new(cxx)
        .arg("-shared")
        .arg(format!("-Wl,--version-script={}", exports.display()))
        .arg("-o")
        .arg(&library)
        .arg("-Wl,-soname,libcuda.so.1")
        .arg("-Wl,--no-undefined")
        .args(objects)
        .arg(version_object)
        .arg("-lpthread")
        .arg("-ldl")
        .status()
        .map_err(|e| format!("running {cxx}: {e}"))?;
    if !status.success() {
        return Err(format!("linking {} failed", library.display()));
    }
    // The development name too, which cudarc tries first: a directory holding both shadows
    // a real driver for processes started with it on LD_LIBRARY_PATH.
    let dev_name = lib_dir.join("libcuda.so");
    let _ = std::fs::remove_file(&dev_name);
    std::os::unix::fs::symlink("libcuda.so.1", &dev_name).map_err(|e| e.to_string())
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set"))
}

fn files_with_extension(dir: &Path, extension: &str) -> Result<Vec<PathBuf>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .map(|entry| entry.path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some(extension))
        .collect();
    files.sort();
    Ok(files)
}

/// A kernel as the source declares it: its name and parameter list.
struct Kernel {
    name: String,
    signature: String,
}

/// The `__global__` functions of `source`, found in its preprocessed text (so that
/// kernels made by macros are found, with their parameters as the macro wrote them).
fn kernels_of(cxx: &str, source: &Path, include: &Path) -> Result<Vec<Kernel>, String> {
    let output = Command::new(cxx)
        .args(["-E", "-P", "-x", "c++", "-I"])
        .arg(include)
        .arg(source)
        .output()
        .map_err(|e| format!("running {cxx} -E: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "preprocessing {}: {}",
            source.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let mut kernels = Vec::new();
    let mut rest: &str = &text;
    while let Some(at) = find_word(rest, "__global__") {
        rest = &rest[at + "__global__".len()..];
        let Some(after_void) = rest.trim_start().strip_prefix("void") else {
            continue;
        };
        let mut after_void = after_void.trim_start();
        // `__global__ void __launch_bounds__(64) name(...)`: the bounds come first.
        if let Some(bounds) = after_void.strip_prefix("__launch_bounds__") {
            let Some(close) = bounds.find(')') else {
                continue;
            };
            after_void = bounds[close + 1..].trim_start();
        }
        let name: String = after_void
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let after_name = after_void[name.len()..].trim_start();
        if name.is_empty() || !after_name.starts_with('(') {
            continue;
        }
        let mut depth = 0;
        let mut end = None;
        for (i, c) in after_name.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let end =
            end.ok_or_else(|| format!("{}: unbalanced parameters of {name}", source.display()))?;
        let signature = after_name[1..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        kernels.push(Kernel { name, signature });
    }
    Ok(kernels)
}

/// The first `word` in `text` that stands alone (not part of a longer identifier).
fn find_word(text: &str, word: &str) -> Option<usize> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(i) = text[from..].find(word) {
        let at = from + i;
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        if !before.is_some_and(is_ident) && !after.is_some_and(is_ident) {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// `text` (of `source`) with each `__shared__` declaration (outside comments and literals)
/// made a `__standin_shared__` one followed by ` ::standin::shared_reached(&name,
/// sizeof(name));`, and a `#line` so that the
/// compiler's messages name the original file and lines. One variable per declaration:
/// anything else is refused rather than left unpoisoned.
fn poison_shared(source: &Path, text: &str) -> Result<String, String> {
    let path = source
        .canonicalize()
        .map_err(|e| format!("{}: {e}", source.display()))?;
    let bytes = text.as_bytes();
    let mut out = format!("#line 1 {:?}\n", path.display().to_string());
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    let mut copied = 0;
    // Skips a comment or literal starting at `i`, returning where it ends (or `i`).
    let skip = |i: usize| -> usize {
        if bytes[i..].starts_with(b"//") {
            return bytes[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(bytes.len(), |p| i + p);
        }
        if bytes[i..].starts_with(b"/*") {
            return bytes[i + 2..]
                .windows(2)
                .position(|w| w == b"*/")
                .map_or(bytes.len(), |p| i + 2 + p + 2);
        }
        if bytes[i] == b'"' || bytes[i] == b'\'' {
            let quote = bytes[i];
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != quote {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            return (j + 1).min(bytes.len());
        }
        i
    };
    while i < bytes.len() {
        let after = skip(i);
        if after != i {
            i = after;
            continue;
        }
        let word = b"__shared__";
        let starts_word = bytes[i..].starts_with(word)
            && (i == 0 || !is_ident(bytes[i - 1]))
            && !bytes.get(i + word.len()).is_some_and(|&c| is_ident(c));
        if !starts_word {
            i += 1;
            continue;
        }
        // The declaration runs to the first `;` outside brackets.
        let start = i + word.len();
        let mut j = start;
        let mut depth = 0i32;
        let mut name_end = None;
        while j < bytes.len() {
            let after = skip(j);
            if after != j {
                j = after;
                continue;
            }
            match bytes[j] {
                b'(' | b'[' | b'{' | b'<' => {
                    if depth == 0 && bytes[j] != b'<' && name_end.is_none() {
                        name_end = Some(j);
                    }
                    depth += 1;
                }
                b')' | b']' | b'}' | b'>' => depth -= 1,
                b'=' if depth == 0 && name_end.is_none() => name_end = Some(j),
                b',' if depth == 0 => {
                    return Err(format!(
                        "{}: a `__shared__` declaration of more than one variable: declare one per line",
                        source.display()
                    ))
                }
                b';' if depth == 0 => break,
                _ => {}
            }
            j += 1;
        }
        if j >= bytes.len() {
            return Err(format!(
                "{}: a `__shared__` declaration without its `;`",
                source.display()
            ));
        }
        let declarator = &text[start..name_end.unwrap_or(j)];
        let name: String = declarator
            .trim_end()
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(format!(
                "{}: cannot tell the variable `__shared__{declarator}` declares",
                source.display()
            ));
        }
        // `__standin_shared__` (kernel.h): a `__shared__` left as it is, in a header this
        // does not rewrite, fails to compile instead of going unpoisoned.
        out.push_str(&text[copied..i]);
        out.push_str("__standin_shared__");
        out.push_str(&text[start..=j]);
        out.push_str(&format!(
            " ::standin::shared_reached(&{name}, sizeof({name}));"
        ));
        copied = j + 1;
        i = j + 1;
    }
    out.push_str(&text[copied..]);
    Ok(out)
}

fn registration(source: &Path, compiled: &Path, kernels: &[Kernel]) -> Result<String, String> {
    let file = source
        .file_name()
        .and_then(|f| f.to_str())
        .ok_or("a kernel file without a name")?;
    let mut text = format!(
        "// Generated by tests/cuda_standin/build.rs from {file}: its kernels' host builds.\n\
         #include \"{}\"\n#include \"registry.h\"\nnamespace {{\nconst ::standin::KernelEntry entries[] = {{\n",
        compiled.display()
    );
    for k in kernels {
        text.push_str(&format!(
            "    STANDIN_KERNEL({}, {:?}, {:?}),\n",
            k.name, file, k.signature
        ));
    }
    text.push_str(
        "};\nconst ::standin::Registration registration(entries, sizeof(entries) / sizeof(entries[0]));\n}  // namespace\n",
    );
    Ok(text)
}
