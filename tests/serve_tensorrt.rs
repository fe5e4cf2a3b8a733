//! celer with TensorRT, end to end, as a user runs it on a machine with GPUs of two
//! models: `celer build` writes one plan per GPU model with its manifest and timing cache,
//! keeps what is current on a second run and rebuilds what a changed ONNX file or
//! TensorRT version made stale; `celer serve --devices 0,1` serves the plans (TensorRT
//! engines on both GPUs, celer's kernels around them) over HTTP with the CPU path's
//! cut-outs, routes to both GPUs and drains on SIGTERM; `--build-engines` builds a missing
//! plan at start-up; a GPU serving engines whose context fails (in celer's kernel or
//! inside TensorRT's enqueue) leaves service, the other GPU serves every client until the
//! server has drained, and the process exits for the platform to restart it (TensorRT's
//! state in the lost context cannot be used again in this process); faults of TensorRT
//! itself reach clients as statuses.
//!
//! These run on the stand-ins (tests/cuda_standin, tests/tensorrt_standin): they shape the
//! machine (how many GPUs, which compute capabilities) and inject faults through the
//! stand-ins' settings, so they fail on real hardware rather than prove less there.

mod common;
mod gpu_support;
mod serve_support;
mod trt_support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use celer::engines::manifest::{list_manifests, EngineManifest};
use serve_support::{cutout, max_difference, Server};

/// The machine `celer build` runs on: three GPUs, two of one model (sm_90), one of
/// another (sm_80).
const BUILD_MACHINE: [(&str, &str); 2] = [
    ("CELER_CUDA_STANDIN_DEVICES", "3"),
    ("CELER_CUDA_STANDIN_SM", "90,80,90"),
];
/// The machine `celer serve` runs on: GPU 0 sm_90, GPU 1 sm_80 (the models built above).
const SERVE_MACHINE: [(&str, &str); 2] = [
    ("CELER_CUDA_STANDIN_DEVICES", "2"),
    ("CELER_CUDA_STANDIN_SM", "90,80"),
];

fn require_standins() {
    assert!(
        trt_support::is_standin(),
        "these tests shape the machine and inject faults through the stand-ins' settings: run \
         them on the stand-in CUDA driver and TensorRT (CELER_TEST_CUDA=standin)"
    );
}

/// A model directory of its own (U2NetP's celer.toml and ONNX file), so that engines can
/// be written into it and its ONNX file changed.
fn model_dir_copy() -> tempfile::TempDir {
    let source = common::model_dir("u2netp");
    let dir = tempfile::tempdir().unwrap();
    for file in ["celer.toml", "u2netp.onnx"] {
        std::fs::copy(source.join(file), dir.path().join(file)).unwrap();
    }
    dir
}

/// `celer build --model-dir DIR` on the stand-ins, with `env`.
fn build(dir: &Path, env: &[(&str, &str)]) -> (Output, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_celer"));
    command
        .args(["build", "--model-dir"])
        .arg(dir)
        .env("CELER_LOG", "warn")
        .env("CELER_CUDA_STANDIN_QUIET", "1")
        .envs(env.iter().copied());
    trt_support::use_tensorrt(&mut command);
    let output = command.output().expect("celer build runs");
    let text = common::printed(&output);
    (output, text)
}

fn manifests(dir: &Path) -> Vec<EngineManifest> {
    list_manifests(&dir.join("engines"))
        .iter()
        .map(|m| EngineManifest::read(m).unwrap())
        .collect()
}

/// `celer serve --model-dir DIR ARGS` on the stand-ins, waited for until `/ping` is 200.
fn serve(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
    let mut command = Server::command(dir, args, env);
    command.env("CELER_CUDA_STANDIN_QUIET", "1");
    trt_support::use_tensorrt(&mut command);
    Server::spawn(command, Duration::from_secs(300))
}

/// A metric's value for `device`, 0 when absent.
fn metric(server: &Server, family: &str, device: &str) -> f64 {
    let text = String::from_utf8(server.get("/metrics").1).expect("metrics text");
    let label = format!("device=\"{device}\"");
    text.lines()
        .filter(|l| l.starts_with(family) && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Appends a second `doc_string` to the ONNX file: the same model (protobuf keeps the
/// last value of a field), other bytes, so its sha256 changes as an edited export's would.
fn change_onnx(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let doc = b"re-exported";
    bytes.push(0x32); // field 6 (doc_string), length-delimited
    bytes.push(doc.len() as u8);
    bytes.extend_from_slice(doc);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn build_writes_a_plan_per_gpu_model_then_serve_runs_them_on_both_gpus() {
    require_standins();
    let dir = model_dir_copy();
    let model_dir = dir.path();

    // First build: one plan per GPU model (sm_90 serves GPUs 0 and 2), with manifests and a
    // timing cache each.
    let (out, text) = build(model_dir, &BUILD_MACHINE);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("compute capability 9.0") && text.contains("compute capability 8.0"),
        "{text}"
    );
    assert!(
        text.contains("2 engine(s) built, 0 current engine(s) kept"),
        "{text}"
    );
    assert!(
        text.contains("phase: Building the engine"),
        "the builder's progress: {text}"
    );
    let built = manifests(model_dir);
    let mut capabilities: Vec<&str> = built
        .iter()
        .map(|m| m.gpu.compute_capability.as_str())
        .collect();
    capabilities.sort();
    assert_eq!(capabilities, ["8.0", "9.0"], "one plan per GPU model");
    for m in &built {
        assert_eq!(m.tensorrt_version.to_string(), "10.16.0");
        assert_eq!(m.model, "u2netp");
        assert!(
            m.plan_bytes > 4_000_000,
            "the plan carries the network: {m:?}"
        );
    }
    let caches: Vec<PathBuf> = std::fs::read_dir(model_dir.join("engines/timing-cache"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(caches.len(), 2, "a timing cache per GPU model: {caches:?}");

    // Second build: everything is current and kept.
    let (out, text) = build(model_dir, &BUILD_MACHINE);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("0 engine(s) built, 2 current engine(s) kept"),
        "{text}"
    );
    assert!(
        text.contains("timing cache") && text.contains("(reused)"),
        "{text}"
    );
    assert_eq!(manifests(model_dir), built, "kept engines are untouched");

    // A newer TensorRT: both plans are stale, and serve refuses them meanwhile.
    let newer = [
        BUILD_MACHINE[0],
        BUILD_MACHINE[1],
        ("CELER_TRT_STANDIN_VERSION", "10.17.0"),
    ];
    let (out, text) = build(model_dir, &newer);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("rebuilding: built with TensorRT 10.16.0, this is TensorRT 10.17.0"),
        "{text}"
    );
    assert!(text.contains("2 engine(s) built, 0 current"), "{text}");
    let mut refused = Server::command(model_dir, ["--devices", "0,1"], &SERVE_MACHINE);
    trt_support::use_tensorrt(&mut refused);
    let out = refused
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let log = common::printed(&out);
    assert!(
        !out.status.success(),
        "serve refuses plans of another TensorRT: {log}"
    );
    assert!(
        log.contains("built with TensorRT 10.17.0, this is TensorRT 10.16.0"),
        "{log}"
    );
    assert!(
        log.contains("celer build --model-dir"),
        "the fix is named: {log}"
    );

    // A re-exported ONNX file (back on 10.16): stale again, for that reason.
    change_onnx(&model_dir.join("u2netp.onnx"));
    let (out, text) = build(model_dir, &BUILD_MACHINE);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("built from another u2netp.onnx"), "{text}");
    assert!(text.contains("2 engine(s) built, 0 current"), "{text}");

    // Serving the plans: TensorRT on both GPUs, the CPU's cut-outs to within 1 LSB.
    let gpus = serve(
        model_dir,
        &["--devices", "0,1", "--replicas", "2"],
        &SERVE_MACHINE,
    );
    let log = gpus.log();
    assert!(
        log.contains("TensorRT loaded: the GPUs serve from engines"),
        "{log}"
    );
    assert_eq!(
        log.matches("engine loaded").count(),
        2,
        "an engine per GPU: {log}"
    );
    assert_eq!(
        log.matches("models=\"TensorRT\"").count() + log.matches("models=TensorRT").count(),
        4,
        "{log}"
    );
    let cpu = Server::start(&common::model_dir("u2netp"), ["--devices", "cpu"], &[]);
    for name in ["astronaut.png", "photo-1920x1080.jpg", "chelsea-exif6.jpg"] {
        let photo = common::fetched(name);
        let (status, on_gpu) = cutout(&gpus, &photo);
        assert_eq!(status, 200, "{name} from the engines: {}", gpus.log());
        let (status, on_cpu) = cutout(&cpu, &photo);
        assert_eq!(status, 200, "{name} on the CPU");
        let worst = max_difference(&on_gpu.unwrap(), &on_cpu.unwrap());
        // Straight to the terminal, past libtest's capture: the figure the run measured.
        let _ = writeln!(
            std::io::stderr(),
            "{name}: the engines' cut-out differs from the CPU path's by at most {worst} LSB"
        );
        assert!(
            worst <= 1,
            "{name}: the engines' cut-out differs by {worst}"
        );
    }
    cpu.stop_cleanly();

    // Routing: concurrent requests reach both GPUs. Each client retries a refusal for the
    // queue budget (503 overloaded), as a client told to retry would: the budget is
    // measured in the stand-in GPUs' service times, which the parallel tests vary.
    let photo = std::fs::read(common::fetched("astronaut.png")).unwrap();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                let post = || gpus.post("/invocations", &[("Content-Type", "image/png")], &photo);
                let mut answer = post();
                for _ in 0..20 {
                    let overloaded = answer.status == 503
                        && String::from_utf8_lossy(&answer.body).contains("\"overloaded\"");
                    if !overloaded {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(250));
                    answer = post();
                }
                assert_eq!(
                    answer.status,
                    200,
                    "{}",
                    String::from_utf8_lossy(&answer.body)
                );
            });
        }
    });
    for device in ["gpu0", "gpu1"] {
        let served = metric(&gpus, "celer_inference_request_success", device);
        assert!(
            served >= 1.0,
            "{device} served {served} requests: routing uses both GPUs"
        );
    }

    // SIGTERM drains: requests in flight when it arrives are answered, then celer exits 0.
    // In flight exactly: each one's handler has asked for its body (100 Continue) and had
    // it; a request still in the listen queue at SIGTERM is refused, as it should be.
    let in_flight: Vec<_> = (0..4)
        .map(|i| {
            let begun =
                serve_support::Begun::post(gpus.address, "/invocations", "image/png", &photo)
                    .unwrap_or_else(|| panic!("request {i} was not begun: {}", gpus.log()));
            std::thread::spawn(move || begun.finish().status)
        })
        .collect();
    let status = gpus.stop();
    let answers: Vec<u16> = in_flight.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(
        answers.iter().all(|&s| s == 200),
        "requests in flight at SIGTERM: {answers:?}"
    );
}

#[test]
fn build_engines_builds_a_missing_plan_at_start_up_and_serves_it() {
    require_standins();
    let dir = model_dir_copy();
    let server = serve(
        dir.path(),
        &["--devices", "0", "--build-engines"],
        &SERVE_MACHINE,
    );
    let log = server.log();
    assert!(log.contains("building the TensorRT engine"), "{log}");
    assert!(log.contains("engine built"), "{log}");
    let (status, cutout) = cutout(&server, &common::fetched("astronaut.png"));
    assert_eq!(status, 200, "{}", server.log());
    assert!(cutout.is_some());
    let built = manifests(dir.path());
    assert_eq!(built.len(), 1, "the plan was stored for the next start");
    assert_eq!(built[0].gpu.compute_capability, "9.0");
    server.stop_cleanly();
}

/// `celer build --precision fp16` on a GPU machine: the FP16 variant is made and passes its
/// gate, the engine is built from it (TensorRT 10: with its FP16 flag), and `serve` runs
/// that engine, saying so in its log and in `/metrics`; the CPU's view of the same folder
/// stays FP32 (no INT8 variant there). `--fp32` builds nothing from the variant.
#[test]
fn the_engines_are_built_from_the_fp16_variant_and_served() {
    require_standins();
    let dir = model_dir_copy();
    let machine = [
        ("CELER_CUDA_STANDIN_DEVICES", "1"),
        ("CELER_CUDA_STANDIN_SM", "90"),
    ];
    let validation = common::fetched("photos/validation/chelsea.png")
        .parent()
        .unwrap()
        .to_path_buf();
    let mut command = Command::new(env!("CARGO_BIN_EXE_celer"));
    command
        .args(["build", "--model-dir"])
        .arg(dir.path())
        .args(["--precision", "fp16", "--validation"])
        .arg(&validation)
        .env("CELER_LOG", "warn")
        .env("CELER_CUDA_STANDIN_QUIET", "1")
        .envs(machine);
    trt_support::use_tensorrt(&mut command);
    let out = command.output().expect("celer build runs");
    let text = common::printed(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("gate: IoU >= 0.98"), "{text}");
    assert!(
        text.contains("segmentation fp16 (u2netp.fp16.onnx"),
        "{text}"
    );
    assert!(
        text.contains("precision: fp16"),
        "TensorRT 10's flag: {text}"
    );
    let built = manifests(dir.path());
    assert_eq!(built.len(), 1, "{built:?}");
    assert_eq!(built[0].model, "u2netp.fp16");
    assert_eq!(built[0].onnx_file, "engines/u2netp/fp16/u2netp.fp16.onnx");
    assert_eq!(built[0].precision.to_string(), "fp16");

    let with_variants = [machine[0], machine[1], ("CELER_FP32", "0")];
    let gpu = serve(dir.path(), &["--devices", "0"], &with_variants);
    assert!(gpu.log().contains("segmentation fp16"), "{}", gpu.log());
    assert!(gpu.log().contains("engine loaded"), "{}", gpu.log());
    let (status, cutout) = cutout(&gpu, &common::fetched("astronaut.png"));
    assert_eq!(status, 200, "{}", gpu.log());
    assert!(cutout.is_some());
    let metrics = String::from_utf8(gpu.get("/metrics").1).expect("metrics text");
    assert!(
        metrics.contains("celer_inference_model_stage_duration_us_count{precision=\"fp16\"} 1"),
        "{metrics}"
    );
    gpu.stop_cleanly();

    // --fp32: the engine of the FP32 file, which is not built: serve refuses to start
    // from it, naming `celer build`.
    let mut fp32 = Server::command(dir.path(), ["--devices", "0", "--fp32"], &machine);
    trt_support::use_tensorrt(&mut fp32);
    let out = fp32.stderr(std::process::Stdio::piped()).output().unwrap();
    let log = common::printed(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("FP32 forced"), "{log}");
    assert!(log.contains("celer build --model-dir"), "{log}");
}

/// Sets its flag when dropped, on a panic too.
struct SetOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// With `--build-engines` and the plan missing, the CPU serves while the engine builds
/// (the stand-in holds the build until the test opens its gate), `/ping` answers 200
/// from then with `--ready-while-building`, and once the GPU's engine has loaded the
/// requests move to it: clients sending all along get no failed request across the
/// switch, the CPU takes no new request after it, and both answer the same cut-out.
#[test]
fn the_cpu_serves_while_an_engine_builds_and_requests_move_to_the_gpu_without_a_failure() {
    require_standins();
    let dir = model_dir_copy();
    let gate_dir = tempfile::tempdir().unwrap();
    let gate = gate_dir.path().join("open");
    let gate_env = gate.to_str().unwrap().to_string();
    let mut env = SERVE_MACHINE.to_vec();
    env.push(("CELER_TRT_STANDIN_BUILD_GATE", &gate_env));
    // Ready (the helper waits for /ping 200) while the build is still held.
    let server = serve(
        dir.path(),
        &[
            "--devices",
            "0",
            "--build-engines",
            "--ready-while-building",
        ],
        &env,
    );
    let ping = server.get_json("/ping");
    assert_eq!(ping["status"], "ok", "{ping}");
    assert!(ping["serving"].is_string(), "{ping}");
    server.wait_for_log("building the TensorRT engine", Duration::from_secs(120));

    let photo = common::fetched("astronaut.png");
    let (status, on_cpu) = cutout(&server, &photo);
    assert_eq!(status, 200, "{}", server.log());
    let served = |device| metric(&server, "celer_inference_request_success", device);
    assert_eq!((served("cpu"), served("gpu0")), (1.0, 0.0));
    assert!(
        !server.log().contains("engine built"),
        "the build is held: {}",
        server.log()
    );

    // Clients send all along; the build goes on; they keep sending until the GPU has
    // answered some of their requests after the CPU stopped taking them.
    let body = std::fs::read(&photo).unwrap();
    let retired = "the interim device takes no new request";
    let statuses = std::sync::Mutex::new(Vec::new());
    let switched = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let mut after_switch = 0;
                while after_switch < 3 {
                    let answer =
                        server.post("/invocations", &[("Content-Type", "image/png")], &body);
                    let text = String::from_utf8_lossy(&answer.body).into_owned();
                    statuses.lock().unwrap().push((answer.status, text));
                    if switched.load(std::sync::atomic::Ordering::SeqCst) {
                        after_switch += 1;
                    }
                }
            });
        }
        // Set however this ends, so that the clients stop and a failure here fails the
        // test instead of waiting for them for ever.
        let _switch = SetOnDrop(&switched);
        std::fs::write(&gate, b"").unwrap();
        server.wait_for_log(retired, Duration::from_secs(300));
    });
    let statuses = statuses.into_inner().unwrap();
    let failed: Vec<_> = statuses
        .iter()
        .filter(|(status, _)| *status != 200)
        .collect();
    assert!(failed.is_empty(), "{failed:?} of {}", statuses.len());
    let log = server.log();
    assert!(
        log.contains("engine built") && log.contains("engine loaded"),
        "{log}"
    );

    // From now on the GPU answers everything.
    let cpu_before = served("cpu");
    let gpu_before = served("gpu0");
    assert!(gpu_before >= 1.0, "{log}");
    let (status, on_gpu) = cutout(&server, &photo);
    assert_eq!(status, 200, "{}", server.log());
    assert_eq!(
        (served("cpu"), served("gpu0")),
        (cpu_before, gpu_before + 1.0)
    );
    let worst = max_difference(&on_gpu.unwrap(), &on_cpu.unwrap());
    assert!(
        worst <= 1,
        "the engine's cut-out differs from the CPU's by {worst}"
    );
    let ping = server.get_json("/ping");
    assert_eq!(ping["status"], "ok", "{ping}");
    assert!(ping.get("serving").is_none(), "{ping}");
    server.stop_cleanly();
}

/// A model folder that `celer serve` cannot write, as on SageMaker, where the archive is
/// unpacked as root and celer runs as another user: run as root here, the server drops to
/// uid 10001 (and the folder stays root's); run as another user, the folder loses its
/// write permission.
fn read_only_model_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = model_dir_copy();
    let mode = if running_as_root() { 0o755 } else { 0o555 };
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
    dir
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// `serve` as the user SageMaker's container runs celer as, with its own temporary folder.
fn serve_as_container_user(dir: &Path, args: &[&str], tmp: &Path) -> Server {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let mut command = Server::command(dir, args, &SERVE_MACHINE);
    command
        .env("CELER_CUDA_STANDIN_QUIET", "1")
        .env("TMPDIR", tmp);
    trt_support::use_tensorrt(&mut command);
    if running_as_root() {
        command.uid(10001).gid(10001);
    }
    Server::spawn(command, Duration::from_secs(300))
}

#[test]
fn engines_built_at_start_up_go_to_a_temporary_folder_when_the_model_folder_is_read_only() {
    require_standins();
    let dir = read_only_model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_as_container_user(
        dir.path(),
        &["--devices", "0", "--build-engines"],
        tmp.path(),
    );
    let log = server.log();
    assert!(log.contains("cannot be written"), "{log}");
    assert!(log.contains("engine built"), "{log}");
    let (status, image) = cutout(&server, &common::fetched("astronaut.png"));
    assert_eq!(status, 200, "{}", server.log());
    assert!(image.is_some());
    server.stop_cleanly();
    assert!(
        !dir.path().join("engines").exists(),
        "nothing was written into the model folder"
    );
    // <temporary dir>/celer-engines/<the model folder's own>/<model>/<gpu>/manifest.json
    let built: usize = std::fs::read_dir(tmp.path().join("celer-engines"))
        .unwrap()
        .map(|d| list_manifests(&d.unwrap().path()).len())
        .sum();
    assert_eq!(built, 1, "the engine is in the temporary folder");

    // --engines-dir names a folder of the operator's for both reading and building; a
    // second start finds the engine there and builds nothing.
    let engines = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        engines.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let args = [
        "--devices",
        "0",
        "--build-engines",
        "--engines-dir",
        engines.path().to_str().unwrap(),
    ];
    let first = serve_as_container_user(dir.path(), &args, tmp.path());
    assert!(first.log().contains("engine built"), "{}", first.log());
    first.stop_cleanly();
    let second = serve_as_container_user(dir.path(), &args, tmp.path());
    assert!(!second.log().contains("engine built"), "{}", second.log());
    assert_eq!(cutout(&second, &common::fetched("astronaut.png")).0, 200);
    second.stop_cleanly();
    assert_eq!(list_manifests(engines.path()).len(), 1);
}

/// The exit status of a server that lost a GPU holding TensorRT's state (docs/gpu.md, "A
/// lost GPU"): the platform restarts it.
const RESTART_EXIT_STATUS: i32 = celer::cli::RESTART_EXIT_STATUS as i32;

/// The calls the stand-in driver may count in a lost context per replica of the lost GPU
/// (`calls_in_lost_context`): a replica's discovery of the loss, in the run that meets it
/// (the failed call itself, the stream query that asks whether the context is lost, and
/// the synchronisation and frees of that run's own leftovers on the way out). No call at
/// all comes after: not a health check, a reset, nor a destroy of an engine or context.
const CALLS_TO_DISCOVER_A_LOSS: u64 = 4;

/// One server with clients sending continuously at a time: each serves on two stand-in
/// GPUs with every request's model on the CPU, and two at once on a small machine made
/// requests outlast the shutdown grace.
fn one_busy_server_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|p| p.into_inner())
}

/// What clients sending continuously saw while a GPU serving engines was lost, and what
/// the server did until it exited.
struct LostGpu {
    /// Every answer's status (0: the request, sent, got no answer).
    statuses: Vec<u16>,
    /// /metrics, scraped once readiness answered 503.
    metrics: String,
    exit: std::process::ExitStatus,
    log: String,
    /// The stand-in driver's counters at the server's exit.
    counters: std::collections::BTreeMap<String, u64>,
    /// The replicas per GPU (celer's default for this machine, read from its log).
    replicas: u64,
}

/// `celer serve --devices 0,1` serving engines on two stand-in GPUs, two clients sending
/// continuously (each stops starting requests once readiness answers 503, as a load
/// balancer does), `arm` called once they are being served (it arms a fault); then waits
/// for the server to exit on its own.
fn a_lost_gpu_with_engines(
    args: &[&str],
    env: &[(&str, &str)],
    arm: impl FnOnce(&Server),
) -> LostGpu {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let _one = one_busy_server_at_a_time();
    let dir = model_dir_copy();
    let counters_dir = tempfile::tempdir().unwrap();
    let counters_path = counters_dir.path().join("counters");
    let mut all_env: Vec<(&str, &str)> = vec![SERVE_MACHINE[0], SERVE_MACHINE[1]];
    all_env.extend_from_slice(env);
    all_env.push((
        celer_cuda_standin::COUNTERS_AT_EXIT_ENV,
        counters_path.to_str().unwrap(),
    ));
    let mut all_args = vec![
        "--devices",
        "0,1",
        "--build-engines",
        "--health-check-interval-ms",
        "100",
        "--drain-s",
        "1",
        "--shutdown-grace-s",
        "120",
    ];
    all_args.extend_from_slice(args);
    let server = serve(dir.path(), &all_args, &all_env);
    let photo = std::fs::read(common::fetched("astronaut.png")).unwrap();
    let address = server.address;
    let stopping = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let statuses = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let (stopping, served, statuses, photo) = (
                stopping.clone(),
                served.clone(),
                statuses.clone(),
                photo.clone(),
            );
            std::thread::spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    let answer = serve_support::request(
                        address,
                        "POST",
                        "/invocations",
                        &[("Content-Type", "image/png")],
                        Some(serve_support::Body::Whole(&photo)),
                    );
                    if answer.status == 200 {
                        served.fetch_add(1, Ordering::AcqRel);
                    }
                    statuses
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(answer.status);
                }
            })
        })
        .collect();
    let started = Instant::now();
    while served.load(Ordering::Acquire) < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "not served: {:?}\n{}",
            statuses.lock().unwrap(),
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    arm(&server);
    // The load balancer: once readiness answers 503, no new request is sent here.
    let started = Instant::now();
    let metrics = loop {
        let (status, _) = server.get("/ping");
        if status != 200 {
            let (_, metrics) = server.get("/metrics");
            stopping.store(true, Ordering::Release);
            break String::from_utf8_lossy(&metrics).into_owned();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "readiness still 200 after the fault: {}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    // The listener closes after the drain; the requests in flight then have the grace
    // (long: a run on the stand-in takes seconds on a busy machine).
    for client in clients {
        client.join().unwrap();
    }
    let log = server.log_handle();
    let exit = server.wait_within(Duration::from_secs(180));
    let log = log();
    let counters = celer_cuda_standin::counters_written_at_exit(&counters_path)
        .unwrap_or_else(|e| panic!("{e}\n{log}"));
    let replicas = log
        .lines()
        .filter(|l| l.contains("GPU replica ready") && l.contains("gpu0"))
        .count() as u64;
    let statuses = statuses.lock().unwrap().clone();
    LostGpu {
        statuses,
        metrics,
        exit,
        log,
        counters,
        replicas,
    }
}

impl LostGpu {
    /// Every promise of the policy for a lost GPU holding TensorRT's state: exactly one
    /// GPU lost (once: never reset), every client answered (200, or a 5xx status for the
    /// requests that met the loss), the loss reported (log, `celer_device_lost`), no call
    /// on the lost GPU beyond each replica's discovery, and the drained exit with the
    /// documented status, whose log says why.
    fn check_the_restart(&self) {
        let (log, counters) = (&self.log, &self.counters);
        let lost = |d: u32| counters.get(&format!("lost_contexts[{d}]")).copied();
        let lost_gpus: Vec<u32> = (0..2).filter(|&d| lost(d).unwrap_or(0) > 0).collect();
        assert_eq!(lost_gpus.len(), 1, "{counters:?}\n{log}");
        let gpu = lost_gpus[0];
        assert_eq!(lost(gpu), Some(1), "lost once, never reset: {counters:?}");
        assert!(
            self.statuses.iter().all(|s| matches!(s, 200 | 500 | 503)),
            "every client answered: {:?}\n{log}",
            self.statuses
        );
        assert!(self.replicas >= 1, "{log}");
        let calls = counters[&format!("calls_in_lost_context[{gpu}]")];
        assert!(
            calls <= CALLS_TO_DISCOVER_A_LOSS * self.replicas,
            "{calls} calls in GPU {gpu}'s lost context for {} replicas: {counters:?}\n{log}",
            self.replicas
        );
        assert!(
            self.metrics
                .lines()
                .any(|l| l.starts_with("celer_device_lost")
                    && l.contains(&format!("device=\"gpu{gpu}\""))
                    && l.ends_with(" 1")),
            "{}",
            self.metrics
        );
        assert!(
            log.lines().any(
                |l| l.contains("GPU lost: it cannot come back in this process")
                    && l.contains(&format!("gpu{gpu}"))
                    && l.contains("TensorRT")
            ),
            "the loss reported, naming the GPU: {log}"
        );
        assert!(!log.contains("reset it"), "no reset: {log}");
        assert!(!log.contains("device reopened"), "no recovery: {log}");
        assert_eq!(
            self.exit.code(),
            Some(RESTART_EXIT_STATUS),
            "exit status: {}\n{log}",
            self.exit
        );
        assert!(
            log.contains(&format!(
                "exits with status {RESTART_EXIT_STATUS} for the platform to restart it"
            )),
            "{log}"
        );
    }
}

#[test]
fn a_gpu_serving_engines_lost_by_a_kernel_fault_drains_and_exits_for_a_restart() {
    require_standins();
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("cuda-fault");
    let env = [("CELER_CUDA_STANDIN_FAULT_FILE", fault.to_str().unwrap())];
    // A sticky CUDA error of celer's own kernel, on whichever GPU launches next.
    let lost = a_lost_gpu_with_engines(&[], &env, |_| std::fs::write(&fault, "sticky").unwrap());
    lost.check_the_restart();
    assert!(
        lost.log.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{}",
        lost.log
    );
}

#[test]
fn a_sticky_error_inside_enqueue_drains_and_exits_and_a_refused_enqueue_loses_nothing() {
    require_standins();
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("tensorrt-fault");
    let env = [("CELER_TRT_STANDIN_FAULT_FILE", fault.to_str().unwrap())];
    let lost = a_lost_gpu_with_engines(&[], &env, |server| {
        // An enqueue TensorRT refuses (no CUDA error): that run fails, and no device is lost.
        std::fs::write(&fault, "enqueue").unwrap();
        let started = Instant::now();
        while fault.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(server.get("/ping").0, 200, "{}", server.log());
        assert!(!server.log().contains("device lost"), "{}", server.log());
        // A sticky CUDA error inside enqueueV3 (a kernel of the engine hit an illegal
        // address): the failed enqueue itself loses the device.
        std::fs::write(&fault, "enqueue-sticky").unwrap();
    });
    lost.check_the_restart();
    // The refused enqueue's request failed on its GPU (its client got a 500, or the
    // answer of the other GPU it failed over to), which stayed in service.
    assert!(
        lost.log
            .contains("enqueueV3 of `u2netp`: injected fault (CELER_TRT_STANDIN_FAULT_FILE)"),
        "{}",
        lost.log
    );
    assert!(
        lost.log.lines().any(|l| l.contains("device lost")
            && l.contains("enqueueV3 failed")
            && l.contains("CUDA_ERROR_ILLEGAL_ADDRESS")),
        "the failed enqueue itself lost the device: {}",
        lost.log
    );
}

#[test]
fn a_hung_gpu_answers_its_stuck_client_and_the_server_exits_for_a_restart() {
    require_standins();
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("cuda-fault");
    let env = [("CELER_CUDA_STANDIN_FAULT_FILE", fault.to_str().unwrap())];
    // A kernel of celer's that never ends, on whichever GPU launches next: its replica
    // blocks in the stream's synchronisation, past the 30 s deadline (long enough for the
    // stand-in's runs on a busy machine), and 5 s after its start its GPU counts as hung.
    let hung = a_lost_gpu_with_engines(&["--deadline-s", "30"], &env, |_| {
        std::fs::write(&fault, "hang").unwrap()
    });
    let (log, counters) = (&hung.log, &hung.counters);
    assert!(log.contains("hangs (injected)"), "{log}");
    assert_eq!(
        counters.get("hanging_now"),
        Some(&1),
        "still hung when the process exited (no thread waited for it): {counters:?}"
    );
    assert!(
        hung.statuses.iter().all(|s| matches!(s, 200 | 500 | 503)),
        "every client answered: {:?}\n{log}",
        hung.statuses
    );
    assert!(
        hung.statuses.contains(&503),
        "the stuck request's answer at its deadline: {:?}\n{log}",
        hung.statuses
    );
    assert!(
        log.lines().any(
            |l| l.contains("GPU lost: it cannot come back in this process")
                && l.contains("stuck past its deadline")
        ),
        "{log}"
    );
    assert!(
        hung.metrics
            .lines()
            .any(|l| l.starts_with("celer_device_lost") && l.ends_with(" 1")),
        "{}",
        hung.metrics
    );
    assert_eq!(hung.exit.code(), Some(RESTART_EXIT_STATUS), "{log}");
    assert!(
        log.contains(&format!(
            "exits with status {RESTART_EXIT_STATUS} for the platform to restart it"
        )),
        "{log}"
    );
}

#[test]
fn a_plan_that_fails_to_deserialize_at_start_up_stops_the_start_saying_why() {
    require_standins();
    let dir = model_dir_copy();
    let (out, text) = build(dir.path(), &SERVE_MACHINE);
    assert!(out.status.success(), "{text}");
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("tensorrt-fault");
    std::fs::write(&fault, "deserialize").unwrap();
    let env = [
        SERVE_MACHINE[0],
        SERVE_MACHINE[1],
        ("CELER_TRT_STANDIN_FAULT_FILE", fault.to_str().unwrap()),
    ];
    let mut command = Server::command(dir.path(), ["--devices", "0"], &env);
    trt_support::use_tensorrt(&mut command);
    let out = command.output().unwrap();
    let log = common::printed(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("the models failed to load"), "{log}");
    assert!(
        log.contains("deserializeCudaEngine") && log.contains("injected fault"),
        "{log}"
    );
}
