//! Every kernel file compiles with each NVRTC celer uses (13, and 12.2 for drivers from
//! celer's floor up) for every architecture celer targets (sm_75, sm_80, sm_86, sm_89,
//! sm_90), and each CUBIN defines every kernel its launchers name; a driver gets the
//! newest NVRTC, and the cached CUBINs, not newer than itself. No GPU needed, but both
//! NVRTCs are: these tests FAIL (not skip) without them, because `make python` installs
//! them (nvidia-cuda-nvrtc and nvidia-cuda-nvrtc-cu12 in scripts/requirements.txt).
//!
//! No kernel a request runs computes in FP64: the PTX of every kernel file, from each
//! NVRTC for each architecture, has no `.f64` operand, so that the T4, A10G and L4 (FP64
//! at 1/32 to 1/64 of FP32) run them at FP32 speed (docs/gpu.md, "Arithmetic on the GPUs
//! users rent").

use std::collections::HashMap;

use celer::cuda::kernels::{
    compile_all, read_cache_from, write_cache_to, COMMON_HEADER, COMPILE_OPTIONS, FILES,
    TESTED_ARCHS,
};
use celer::cuda::nvrtc::{Nvrtc, Source};
use celer::cuda::Arch;
use celer::cuda::{CudaVersion, DRIVER_FLOOR};

fn nvrtc() -> &'static Nvrtc {
    Nvrtc::get().unwrap_or_else(|e| {
        panic!("NVRTC is required for these tests (CI installs it with `make python`): {e}")
    })
}

/// Whether `name` appears as a whole NUL-terminated symbol name in the CUBIN (an ELF
/// whose string table holds every kernel's name).
fn defines(cubin: &[u8], name: &str) -> bool {
    let needle = [name.as_bytes(), b"\0"].concat();
    cubin.windows(needle.len()).enumerate().any(|(i, w)| {
        w == needle.as_slice() && (i == 0 || cubin[i - 1] == 0 || cubin[i - 1] == b'.')
    })
}

/// Both NVRTCs, newest first: 13 and the floor's.
fn nvrtcs() -> &'static [Nvrtc] {
    let all = Nvrtc::all().unwrap_or_else(|e| {
        panic!("NVRTC is required for these tests (CI installs it with `make python`): {e}")
    });
    let versions: Vec<String> = all.iter().map(|n| n.version().to_string()).collect();
    assert!(
        all.len() >= 2
            && all[0].version().major == 13
            && all.iter().any(|n| n.version() == DRIVER_FLOOR),
        "NVRTC 13 and {DRIVER_FLOOR} are needed (`make python` installs both); found {versions:?}"
    );
    all
}

#[test]
fn every_kernel_compiles_for_every_target_architecture_with_each_nvrtc() {
    for nvrtc in nvrtcs() {
        compiles_everything(nvrtc);
    }
}

fn compiles_everything(nvrtc: &Nvrtc) {
    let version = nvrtc.version();
    println!("NVRTC {version} from {}", nvrtc.path());
    let supported = nvrtc.supported_archs().expect("supported archs");
    println!(
        "NVRTC supports: {}",
        supported
            .iter()
            .map(Arch::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    for arch in TESTED_ARCHS {
        assert!(
            supported.contains(&arch),
            "NVRTC {version} cannot target {arch}"
        );
        let t = std::time::Instant::now();
        let cubins = compile_all(nvrtc, arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cubins.files.len(), FILES.len());
        assert_eq!(cubins.nvrtc, version);
        for (file, (name, cubin)) in FILES.iter().zip(&cubins.files) {
            assert_eq!(file.name, *name);
            // An ELF file.
            assert_eq!(&cubin[..4], b"\x7fELF", "{name} for {arch} is not a CUBIN");
            for kernel in file.kernels {
                assert!(
                    defines(cubin, kernel),
                    "{name} for {arch} lacks kernel `{kernel}`"
                );
            }
            println!(
                "  {arch} {name}: {} bytes, kernels {:?}",
                cubin.len(),
                file.kernels
            );
        }
        println!(
            "{arch}: {} files in {:.2?}",
            cubins.files.len(),
            t.elapsed()
        );
    }
}

#[test]
fn a_driver_gets_the_newest_nvrtc_not_newer_than_itself() {
    let all = nvrtcs();
    let newest = all[0].version();
    assert_eq!(Nvrtc::for_driver(newest).unwrap().version(), newest);
    assert_eq!(
        Nvrtc::for_driver(CudaVersion::new(99, 0))
            .unwrap()
            .version(),
        newest
    );
    // Between the two (a 12.8 driver; a 13.0 driver when NVRTC 13 is newer than 13.0).
    for driver in [
        DRIVER_FLOOR,
        CudaVersion::new(12, 8),
        CudaVersion::new(13, 0),
    ] {
        let chosen = Nvrtc::for_driver(driver).unwrap().version();
        assert!(chosen <= driver, "NVRTC {chosen} for a {driver} driver");
        assert!(
            all.iter()
                .all(|n| n.version() > driver || n.version() <= chosen),
            "NVRTC {chosen} for a {driver} driver, not the newest that fits"
        );
    }
    // Older than every NVRTC: the error says what was found and what to install.
    let refusal = Nvrtc::for_driver(CudaVersion::new(12, 1))
        .err()
        .expect("no NVRTC for 12.1")
        .to_string();
    assert!(
        refusal.contains("12.1")
            && refusal.contains("NVRTC 12.2")
            && refusal.contains("CELER_NVRTC_PATH"),
        "{refusal}"
    );
}

#[test]
fn a_compile_error_carries_the_log() {
    let nvrtc = nvrtc();
    let source = Source {
        name: "broken.cu",
        text: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        headers: &[],
    };
    let err = nvrtc
        .compile_cubin(&source, Arch::new(8, 0), &[])
        .expect_err("must not compile")
        .to_string();
    assert!(
        err.contains("broken.cu") && err.contains("undefined_name"),
        "{err}"
    );
}

#[test]
fn the_disk_cache_gives_back_what_was_compiled_to_the_drivers_that_load_it() {
    let all = nvrtcs();
    let (newest, floor) = (all[0].version(), DRIVER_FLOOR);
    let on_floor = Nvrtc::for_driver(floor).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let arch = Arch::new(8, 6);
    assert!(
        read_cache_from(dir.path(), arch, newest).is_none(),
        "empty cache"
    );
    let newer = compile_all(&all[0], arch).unwrap();
    write_cache_to(dir.path(), &newer).unwrap();
    let read = read_cache_from(dir.path(), arch, newest).expect("cached");
    assert_eq!(read.files, newer.files);
    assert_eq!(read.nvrtc, newest);
    // A driver older than that NVRTC is not given its CUBINs...
    assert!(read_cache_from(dir.path(), arch, floor).is_none());
    // ... but the floor NVRTC's, once cached, which a newer driver takes only when nothing
    // newer is there.
    let older = compile_all(on_floor, arch).unwrap();
    write_cache_to(dir.path(), &older).unwrap();
    assert_eq!(
        read_cache_from(dir.path(), arch, floor).unwrap().files,
        older.files
    );
    assert_eq!(
        read_cache_from(dir.path(), arch, newest).unwrap().nvrtc,
        newest
    );
    // Another architecture is not served from this one's files.
    assert!(read_cache_from(dir.path(), Arch::new(9, 0), newest).is_none());
}

/// Kernels allowed to compute in FP64, each with the reason. Every kernel celer has is
/// run by some request, so none is: an entry here needs a reason a reviewer accepts.
const KEEPS_FP64: &[(&str, &str)] = &[];

/// One FP64 operation in PTX: the function it is in, the source line it came from
/// (`file:line`, with the kernel's line where it was inlined from a device function), and
/// the instruction.
#[derive(Debug)]
struct Fp64Use {
    function: String,
    line: String,
    instruction: String,
}

/// Every line of `ptx` (compiled with line info) whose operands are `.f64`, with its
/// function and source line: instructions (`add.f64`, `cvt.f32.f64`, `ld.global.f64`) and
/// f64 register declarations alike.
fn fp64_uses(ptx: &str) -> Vec<Fp64Use> {
    let mut files: HashMap<&str, &str> = HashMap::new();
    for line in ptx.lines() {
        // `.file 1 "/dir/resample.cu"` (possibly followed by a timestamp and size).
        if let Some(rest) = line.trim().strip_prefix(".file") {
            let mut parts = rest.trim().splitn(2, char::is_whitespace);
            if let (Some(id), Some(path)) = (parts.next(), parts.next()) {
                let path = path.split('"').nth(1).unwrap_or(path);
                files.insert(id, path.rsplit('/').next().unwrap_or(path));
            }
        }
    }
    let place = |file: &str, line: &str| format!("{}:{line}", files.get(file).unwrap_or(&file));
    let (mut function, mut at) = (String::new(), "declarations".to_string());
    let mut uses = Vec::new();
    for line in ptx.lines() {
        let text = line.split("//").next().unwrap_or("").trim();
        if text.contains(".entry") || text.contains(".func") {
            // `.visible .entry name(` or `.func (.param ...) name(`: the name before `(`.
            let head = text.trim_end_matches('(');
            let head = head.rsplit_once(')').map_or(head, |(_, h)| h);
            function = head.split_whitespace().last().unwrap_or("").to_string();
            function = function.split('(').next().unwrap_or("").to_string();
            at = "declarations".to_string();
        } else if let Some(rest) = text.strip_prefix(".loc") {
            // `.loc 2 30 5, function_name $L__info_string0, inlined_at 1 51 5`
            let mut words = rest.split(|c: char| c.is_whitespace() || c == ',');
            let mut words = words.by_ref().filter(|w| !w.is_empty());
            let (file, number) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
            at = place(file, number);
            if let Some((_, inlined)) = rest.split_once("inlined_at") {
                let mut w = inlined.split_whitespace();
                let (file, number) = (w.next().unwrap_or(""), w.next().unwrap_or(""));
                at = format!("{at} (inlined at {})", place(file, number));
            }
        } else if text
            .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
            .any(|word| word.ends_with(".f64") || word.contains(".f64."))
        {
            uses.push(Fp64Use {
                function: function.clone(),
                line: at.clone(),
                instruction: text.to_string(),
            });
        }
    }
    uses
}

/// The FP64 uses in the kernels of source file `name` (`text`, defining `kernels`) for
/// `arch`, outside [`KEEPS_FP64`], one line per function.
fn fp64_report(
    nvrtc: &Nvrtc,
    (name, text, kernels): (&str, &str, &[&str]),
    arch: Arch,
) -> Vec<String> {
    let source = Source {
        name,
        text,
        headers: &[COMMON_HEADER],
    };
    let mut options = COMPILE_OPTIONS.to_vec();
    options.push("--generate-line-info");
    let ptx = nvrtc
        .compile_ptx(&source, arch, &options)
        .unwrap_or_else(|e| panic!("{e}"));
    for kernel in kernels {
        assert!(
            ptx.contains(&format!(".entry {kernel}(")),
            "{name} for {arch}: no kernel `{kernel}` in its PTX"
        );
    }
    let mut per_function: Vec<(String, Vec<Fp64Use>)> = Vec::new();
    for u in fp64_uses(&ptx) {
        if KEEPS_FP64.iter().any(|(k, _)| *k == u.function) {
            continue;
        }
        match per_function.iter_mut().find(|(f, _)| *f == u.function) {
            Some((_, uses)) => uses.push(u),
            None => per_function.push((u.function.clone(), vec![u])),
        }
    }
    per_function
        .into_iter()
        .map(|(function, uses)| {
            let mut lines: Vec<&str> = Vec::new();
            for u in &uses {
                if !lines.contains(&u.line.as_str()) {
                    lines.push(&u.line);
                }
            }
            format!(
                "{name}: kernel `{function}`: {} FP64 PTX lines (`{}`, ...) from {}",
                uses.len(),
                uses[0].instruction,
                lines.join(", ")
            )
        })
        .collect()
}

#[test]
fn no_kernel_a_request_runs_computes_in_fp64() {
    // Each finding once, with the NVRTCs and architectures it was found for.
    let mut found: Vec<(String, Vec<String>)> = Vec::new();
    for nvrtc in nvrtcs() {
        for arch in TESTED_ARCHS {
            for file in &FILES {
                let target = format!("{arch} by NVRTC {}", nvrtc.version());
                for report in fp64_report(nvrtc, (file.name, file.source, file.kernels), arch) {
                    match found.iter_mut().find(|(r, _)| *r == report) {
                        Some((_, targets)) => targets.push(target.clone()),
                        None => found.push((report, vec![target.clone()])),
                    }
                }
            }
        }
    }
    for (kernel, reason) in KEEPS_FP64 {
        println!("allowed FP64: {kernel} ({reason})");
    }
    let found: Vec<String> = found
        .into_iter()
        .map(|(report, targets)| format!("{report} [{}]", targets.join(", ")))
        .collect();
    assert!(
        found.is_empty(),
        "FP64 in kernels that requests run:\n{}",
        found.join("\n")
    );
}

/// The check's teeth: a planted kernel that computes in `double` because of an f64
/// literal (`x * 0.1` promotes the float; NVRTC keeps `x * 0.5` in f32, which gives the
/// same bits) is named with its line; its float twin passes.
#[test]
fn the_fp64_check_names_a_planted_double_and_passes_its_float_twin() {
    let nvrtc = nvrtc();
    let planted = "#include \"common.cuh\"\n\
        extern \"C\" __global__ void halve(float* x) {\n\
            u64 i = global_index();\n\
            x[i] = x[i] * 0.1;\n\
        }\n";
    let twin = planted.replace("0.1;", "0.1f;");
    let file = |text| ("planted.cu", text, &["halve"][..]);
    let report = fp64_report(nvrtc, file(planted), Arch::new(7, 5));
    assert_eq!(report.len(), 1, "{report:?}");
    assert!(
        report[0].contains("kernel `halve`") && report[0].contains("planted.cu:4"),
        "{report:?}"
    );
    assert!(fp64_report(nvrtc, file(&twin), Arch::new(7, 5)).is_empty());
}
