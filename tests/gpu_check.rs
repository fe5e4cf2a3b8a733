//! `make gpu-check`'s pack, built and run here end to end on the stand-in CUDA driver, so
//! that it cannot rot between the rare times a GPU is lent: scripts/gpu-check builds it
//! (its kernels for sm_90 alone, the stand-in's architecture, to keep this short) and
//! checks its size; then its `run --standin --quick` runs every step with `OUT` set, the
//! stand-in on `LD_LIBRARY_PATH` and NVRTC hidden, as a GPU machine has none. The report,
//! steps.json, bench.json, counts.json and logs.tar.gz must land in `OUT` within what such
//! a machine sends back (at most 8 files of 16 MiB), with every step's result, the
//! TensorRT line, kernel times at 1920x1080 and 4032x3024, and the driver counts; the
//! planted kernel of tests/gpu_recovery.rs must come from the pack's precompiled folder.
//! Then the pack's refusals: a stand-in driver on `LD_LIBRARY_PATH` without `--standin`
//! (the script, and a packed test binary with `CELER_TEST_CUDA=real`), a step past its
//! timeout (named in the report, exit status 1, nothing left running), and a pack over its
//! size limit (the check fails, naming the largest files).
//!
//! Needs what `make gpu-check` needs: the models and photos (`make models`) and NVRTC
//! (`make python`); it fails, saying so, without them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// What a GPU machine's call sends back from `OUT`: at most 8 files of 16 MiB.
const MAX_FILES: usize = 8;
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// The files `run` writes.
const OUTPUTS: [&str; 5] = [
    "report.txt",
    "steps.json",
    "bench.json",
    "counts.json",
    "logs.tar.gz",
];
const STEPS: [&str; 6] = [
    "cuda_gpu",
    "counts",
    "bench",
    "gpu_recovery",
    "serve",
    "tensorrt_engine",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// This test's folder under the target directory (not the shared /tmp).
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("gpu-check-standin")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

fn text(output: &Output) -> String {
    format!(
        "exit status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The pack, built once by scripts/gpu-check (cargo's own builds are fresh when this
/// test runs from `cargo test`; the benchmark binary may be built here).
fn pack() -> &'static Path {
    static PACK: OnceLock<PathBuf> = OnceLock::new();
    PACK.get_or_init(|| {
        let dir = scratch("pack");
        let features = if cfg!(feature = "tensorrt") {
            "--features tensorrt"
        } else {
            ""
        };
        let output = Command::new(root().join("scripts/gpu-check"))
            .arg(&dir)
            .current_dir(root())
            .env("PATH", path_with_cargo())
            .env("CARGO_FEATURES", features)
            .env("GPU_CHECK_ARCHS", "sm_90")
            .env_remove("CELER_NVRTC_PATH")
            .output()
            .expect("scripts/gpu-check runs");
        assert!(
            output.status.success(),
            "scripts/gpu-check failed (`make models` and `make python` first):\n{}",
            text(&output)
        );
        let said = String::from_utf8_lossy(&output.stdout);
        assert!(
            said.contains("(at most 60 MiB)"),
            "the build checks the pack's size:\n{said}"
        );
        dir
    })
}

/// PATH with the cargo that runs this test first, for the script's own cargo commands.
fn path_with_cargo() -> std::ffi::OsString {
    let cargo_dir = std::env::var_os("CARGO")
        .map(PathBuf::from)
        .and_then(|c| c.parent().map(Path::to_path_buf));
    let rest = std::env::var_os("PATH").unwrap_or_default();
    let dirs = cargo_dir
        .into_iter()
        .chain(std::env::split_paths(&rest))
        .collect::<Vec<_>>();
    std::env::join_paths(dirs).expect("PATH joins")
}

/// `run ARGS` of the pack with `OUT=out`, the stand-in driver on LD_LIBRARY_PATH, NVRTC
/// hidden (none is packed: the run must not find this checkout's) and its scratch (the
/// unpacked binaries) under `tmp`.
fn run_pack(args: &[&str], out: &Path, tmp: &Path, env: &[(&str, &str)]) -> Output {
    Command::new(pack().join("run"))
        .args(args)
        .env("OUT", out)
        .env("TMPDIR", tmp)
        .env("LD_LIBRARY_PATH", celer_cuda_standin::library_dir())
        .env_remove("CELER_NVRTC_PATH")
        .env_remove("ORT_DYLIB_PATH")
        .envs(env.iter().copied())
        .output()
        .expect("the pack's run starts")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The steps table's line of `step` in the report.
fn step_line<'a>(report: &'a str, step: &str) -> &'a str {
    report
        .lines()
        .skip_while(|l| !l.starts_with("== steps"))
        .find(|l| l.split_whitespace().next() == Some(step))
        .unwrap_or_else(|| panic!("no line for {step} in the report's steps:\n{report}"))
}

/// Each step's result in steps.json, by step.
fn results(steps: &serde_json::Value) -> Vec<(String, String)> {
    steps["steps"]
        .as_array()
        .expect("steps.json: steps")
        .iter()
        .map(|s| {
            (
                s["step"].as_str().unwrap_or_default().to_string(),
                s["result"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

#[test]
fn the_pack_runs_every_step_on_the_stand_in_and_reports_into_out() {
    let out = scratch("out");
    let tmp = scratch("tmp");
    let run = run_pack(&["--standin", "--quick"], &out, &tmp, &[]);
    let report = std::fs::read_to_string(out.join("report.txt")).unwrap_or_default();
    assert!(
        run.status.success(),
        "the pack's run on the stand-in:\n{}\nreport:\n{report}",
        text(&run)
    );

    // Only what comes back from a GPU machine: a few files, none too large, none nested.
    let mut files: Vec<(String, u64)> = std::fs::read_dir(&out)
        .expect("OUT")
        .flatten()
        .map(|e| {
            let meta = e.metadata().expect("metadata");
            assert!(meta.is_file(), "{:?} in OUT is not a file", e.path());
            (e.file_name().to_string_lossy().into_owned(), meta.len())
        })
        .collect();
    files.sort();
    let mut names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    let mut expected = OUTPUTS.to_vec();
    expected.sort_unstable();
    assert_eq!(
        names, expected,
        "OUT holds the report, the JSON and the logs"
    );
    assert!(files.len() <= MAX_FILES);
    for (name, bytes) in &files {
        assert!(*bytes > 0, "{name} is empty");
        assert!(*bytes <= MAX_FILE_BYTES, "{name}: {bytes} bytes");
    }

    // The report: which driver, every step's result, the TensorRT line, the figures.
    assert!(
        report.contains("driver: celer's stand-in CUDA driver"),
        "{report}"
    );
    assert!(
        report
            .lines()
            .any(|l| l == "TensorRT: not installed on this machine — tensorrt_engine not run"),
        "{report}"
    );
    for step in &STEPS[..5] {
        let line = step_line(&report, step);
        assert!(line.contains(" passed "), "{line}");
    }
    assert!(
        step_line(&report, "tensorrt_engine").contains("skipped"),
        "{report}"
    );
    assert!(report.contains("== exit status: 0"), "{report}");
    for size in ["1920x1080", "4032x3024"] {
        assert!(
            report.contains(&format!("kernel ({size} source)")),
            "kernel times at {size}:\n{report}"
        );
    }
    for counted in [
        "1920x1080 repeated",
        "1920x1080 after 1024x768",
        "4032x3024 after 1920x1080",
        "TensorRT's own calls are not included",
        "HtoD copies",
        "DtoH bytes",
        "stream syncs",
        "kernel launches",
        "host registrations",
        "pinned allocations",
    ] {
        assert!(report.contains(counted), "counts: {counted}:\n{report}");
    }
    // The planted kernel came from the pack, not from an NVRTC.
    assert!(
        report
            .lines()
            .any(|l| l.starts_with("planted kernels: sm_90 by NVRTC") && l.contains("precompiled")),
        "gpu_recovery's planted kernel from the pack's precompiled folder:\n{report}"
    );

    let steps = json(&out.join("steps.json"));
    assert_eq!(steps["exit_status"], 0, "{steps}");
    assert_eq!(steps["driver"], "standin", "{steps}");
    assert_eq!(steps["tensorrt"], "not installed", "{steps}");
    let expected: Vec<(String, String)> = STEPS
        .iter()
        .map(|s| {
            let result = if *s == "tensorrt_engine" {
                "skipped"
            } else {
                "passed"
            };
            (s.to_string(), result.to_string())
        })
        .collect();
    assert_eq!(results(&steps), expected);

    // Kernel times at both sizes, each a positive GPU time.
    let bench = json(&out.join("bench.json"));
    for size in ["1920x1080", "4032x3024"] {
        let rows = bench[format!("kernels_{size}")]
            .as_array()
            .unwrap_or_else(|| panic!("bench.json: kernels_{size}: {bench}"));
        assert!(!rows.is_empty(), "{size}");
        for row in rows {
            let ms = row["gpu_ms"].as_f64().unwrap_or(0.0);
            assert!(ms > 0.0, "{size}: {row}");
        }
    }

    // The counts of each request, at least its own pixels' copies each way.
    let counts = json(&out.join("counts.json"));
    let requests = counts["requests"]
        .as_array()
        .expect("counts.json: requests");
    let names: Vec<&str> = requests
        .iter()
        .map(|r| r["request"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        names,
        [
            "1920x1080 repeated",
            "1920x1080 after 1024x768",
            "4032x3024 after 1920x1080"
        ]
    );
    for request in requests {
        let (w, h) = (
            request["size"][0].as_u64().unwrap_or(0),
            request["size"][1].as_u64().unwrap_or(0),
        );
        let c = &request["counts"];
        let at_least = |field: &str, n: u64| {
            assert!(
                c[field].as_u64().unwrap_or(0) >= n,
                "{}: {field} < {n}: {c}",
                request["request"]
            );
        };
        at_least("htod_copies", 1);
        at_least("htod_bytes", 3 * w * h);
        at_least("dtoh_copies", 1);
        at_least("dtoh_bytes", 4 * w * h);
        at_least("stream_syncs", 1);
        at_least("launches", 1);
        for field in ["host_registrations", "pinned_allocs"] {
            assert!(c[field].is_u64(), "{field}: {c}");
        }
    }
    assert!(
        counts["counted_by"]
            .as_str()
            .is_some_and(|s| s.contains("TensorRT's own calls are not included")),
        "{counts}"
    );

    // Every step's log in the bundle.
    let listing = Command::new("tar")
        .arg("tzf")
        .arg(out.join("logs.tar.gz"))
        .output()
        .expect("tar runs");
    let listing = String::from_utf8_lossy(&listing.stdout);
    for step in &STEPS[..5] {
        assert!(
            listing.contains(&format!("logs/{step}.log")),
            "{step}: {listing}"
        );
    }
}

/// Whether any process still runs from under `dir` (the run's unpacked binaries).
fn running_under(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle))
        .collect()
}

#[test]
fn a_step_past_its_timeout_is_named_in_the_report_and_fails_the_run() {
    let out = scratch("out-timeout");
    let tmp = scratch("tmp-timeout");
    // celer serve takes seconds to load on the stand-in: one second cannot do.
    let run = run_pack(
        &["--standin", "--quick", "serve"],
        &out,
        &tmp,
        &[("CELER_GPU_CHECK_TIMEOUT_SERVE", "1")],
    );
    assert_eq!(run.status.code(), Some(1), "{}", text(&run));
    let report = read(&out.join("report.txt"));
    let line = step_line(&report, "serve");
    assert!(
        line.contains("timed out") && line.contains("killed after 1 s"),
        "{line}"
    );
    assert!(
        step_line(&report, "cuda_gpu").contains("not selected"),
        "{report}"
    );
    assert!(
        report.contains("== exit status: 1 (serve timed out)"),
        "{report}"
    );
    let steps = json(&out.join("steps.json"));
    assert_eq!(
        results(&steps),
        [("serve".to_string(), "timed out".to_string())]
    );
    assert_eq!(steps["exit_status"], 1);
    // The timeout ends the whole step, the server it started included.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = running_under(&tmp);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still running: {left:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_stand_in_driver_is_refused_on_a_gpu_machines_run() {
    let out = scratch("out-refused");
    let tmp = scratch("tmp-refused");
    let run = run_pack(&["--quick"], &out, &tmp, &[]);
    assert_eq!(run.status.code(), Some(2), "{}", text(&run));
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(
        said.contains("holds celer's stand-in CUDA driver") && said.contains("--standin"),
        "{said}"
    );
    assert!(
        std::fs::read_dir(&out).expect("OUT").next().is_none(),
        "nothing written"
    );
    // A packed test binary refuses it too when told the driver is real.
    let binary = tmp.join("gpu_recovery");
    let gunzip = Command::new("sh")
        .arg("-c")
        .arg("gunzip -c \"$0\" > \"$1\" && chmod +x \"$1\"")
        .arg(pack().join("bin/gpu_recovery.gz"))
        .arg(&binary)
        .status()
        .expect("gunzip runs");
    assert!(gunzip.success());
    let test = Command::new(&binary)
        .env("CELER_TEST_CUDA", "real")
        .env("LD_LIBRARY_PATH", celer_cuda_standin::library_dir())
        .output()
        .expect("the packed test runs");
    assert!(!test.status.success(), "{}", text(&test));
    assert!(
        text(&test).contains("the CUDA driver the loader finds is celer's stand-in"),
        "{}",
        text(&test)
    );
}

#[test]
fn a_pack_over_its_size_limit_fails_naming_the_largest_files() {
    let check = |mib: &str| {
        Command::new(root().join("scripts/gpu-check"))
            .args(["--check-size"])
            .arg(pack())
            .arg(mib)
            .output()
            .expect("the size check runs")
    };
    let within = check("60");
    assert!(within.status.success(), "{}", text(&within));
    let over = check("1");
    assert!(!over.status.success(), "{}", text(&over));
    let said = String::from_utf8_lossy(&over.stderr);
    assert!(said.contains("over the 1 MiB"), "{said}");
    assert!(
        said.contains("lib/libonnxruntime.so.gz") && said.contains("bin/celer.gz"),
        "the largest files named: {said}"
    );
}
