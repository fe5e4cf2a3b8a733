//! The stand-in TensorRT has teeth. Each test runs a harness (tests/tensorrt_standin/
//! rules/planted.cpp, compiled here against the same TensorRT headers) that lives an
//! engine's life by TensorRT's documented rules with one rule broken, and checks that the
//! stand-in refuses the call or aborts on the broken lifetime, naming the rule; the same
//! harness with nothing broken must pass, so a stand-in that refused everything would
//! fail here too. The harness reaches the libraries as celer's shim does: dlopen and the
//! exported factories. Stand-in only: on real TensorRT these misuses are undefined. Also
//! here: how a CUDA fault surfaces inside `enqueueV3` (a kernel's illegal address, a
//! context already sticky), as real TensorRT reports it; and the rule that follows a lost
//! context: the process must be relaunched, so no TensorRT call touches the device again
//! once the caller knows (an enqueue, a deserialize, destroying an engine).

mod common;
mod gpu_support;
mod trt_support;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The harness, compiled once per test process.
fn harness() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        // The headers celer's shim was compiled against (build.rs), else the ones named now.
        let include = option_env!("CELER_TENSORRT_INCLUDE_DIR")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("TENSORRT_INCLUDE_DIR").map(PathBuf::from))
            .expect("no TensorRT headers: run the tests with TENSORRT_INCLUDE_DIR set (`make test` does)");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "tensorrt-planted-{}",
            std::process::id()
        ));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let status = Command::new(&cxx)
            .args(["-std=c++17", "-O1", "-Wall", "-Wno-deprecated-declarations", "-isystem"])
            .arg(&include)
            .arg("-isystem")
            .arg(trt_support::repo("src/tensorrt/shim/cuda-stub"))
            .arg(trt_support::repo("tests/tensorrt_standin/rules/planted.cpp"))
            .arg("-o")
            .arg(&out)
            .arg("-ldl")
            .status()
            .unwrap_or_else(|e| panic!("cannot run the C++ compiler `{cxx}`: {e}"));
        assert!(status.success(), "compiling the planted-misuse harness failed");
        out
    })
}

/// The model most scenarios run: seg3 (image -> scores, both [b, 3, 64, 64]).
const SEG3: &str = "onnx/fixtures/seg3.onnx";
/// The `data-dependent-*` scenarios' model: an output of data-dependent shape.
const PROB_NONZERO: &str = "onnx/fixtures/prob-nonzero.onnx";

/// Runs `scenario` on seg3 on the stand-ins (two GPUs, sm_90 and sm_80), with `env`.
fn run(scenario: &str, extra: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    run_model(scenario, SEG3, extra, env)
}

/// Runs `scenario` on `model` (a repository file).
fn run_model(
    scenario: &str,
    model: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Output, String) {
    let dir = trt_support::standin_dir();
    let mut command = Command::new(harness());
    command
        .arg(scenario)
        .arg(celer_cuda_standin::library())
        .arg(dir.join("libnvinfer.so.10"))
        .arg(dir.join("libnvonnxparser.so.10"))
        .arg(trt_support::repo(model))
        .args(extra)
        .env("CELER_CUDA_STANDIN_DEVICES", "2")
        .env("CELER_CUDA_STANDIN_SM", "90,80")
        .env("CELER_CUDA_STANDIN_QUIET", "1");
    for (k, v) in env {
        command.env(k, v);
    }
    let output = command.output().expect("the harness runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, text)
}

/// The scenario's call was refused (exit 3) with a message holding each of `words`.
fn refused(scenario: &str, words: &[&str]) {
    refused_on(scenario, SEG3, words);
}

fn refused_on(scenario: &str, model: &str, words: &[&str]) {
    let (output, text) = run_model(scenario, model, &[], &[]);
    assert_eq!(
        output.status.code(),
        Some(3),
        "{scenario} was not refused:\n{text}"
    );
    for word in words {
        assert!(text.contains(word), "{scenario}: no `{word}` in:\n{text}");
    }
}

/// The scenario broke a lifetime rule: the stand-in aborted naming it.
fn aborted(scenario: &str, words: &[&str]) {
    let (output, text) = run(scenario, &[], &[]);
    assert_eq!(
        output.status.signal(),
        Some(libc_sigabrt()),
        "{scenario} did not abort:\n{text}"
    );
    assert!(text.contains("rule violated"), "{scenario}:\n{text}");
    for word in words {
        assert!(text.contains(word), "{scenario}: no `{word}` in:\n{text}");
    }
}

fn libc_sigabrt() -> i32 {
    6
}

#[test]
fn the_documented_life_of_an_engine_passes() {
    let (output, text) = run("ok", &[], &[]);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("DONE ok"), "{text}");
    assert!(
        !text.contains("LOG ERROR") && !text.contains("INTERNAL_ERROR"),
        "{text}"
    );
}

#[test]
fn every_tensor_address_is_set_before_enqueue() {
    refused(
        "no-address",
        &[
            "enqueueV3",
            "`scores` has no address",
            "setTensorAddress before enqueueV3",
        ],
    );
}

#[test]
fn tensor_addresses_are_256_byte_aligned() {
    refused("misaligned", &["setTensorAddress(`image`", "256-byte"]);
}

#[test]
fn input_shapes_are_set_before_output_shapes_are_read_or_enqueue() {
    refused(
        "shape-unset",
        &[
            "getTensorShape(`scores`)",
            "enqueueV3",
            "and none was set",
            "setInputShape before output shapes",
        ],
    );
}

#[test]
fn input_shapes_lie_inside_the_active_profile() {
    refused(
        "shape-outside-profile",
        &[
            "setInputShape(`image`, [3x3x64x64])",
            "[1x3x64x64] to [2x3x64x64]",
        ],
    );
}

#[test]
fn dynamic_inputs_need_an_optimisation_profile() {
    refused(
        "no-profile",
        &["buildSerializedNetwork", "no optimisation profile"],
    );
}

#[test]
fn user_device_memory_is_at_least_the_engines_size() {
    refused(
        "memory-too-small",
        &["setDeviceMemoryV2", "at least getDeviceMemorySizeV2()"],
    );
}

#[test]
fn contexts_running_at_once_do_not_share_device_memory() {
    refused(
        "memory-shared",
        &["enqueueV3 (second context)", "must not share device memory"],
    );
}

#[test]
fn a_cuda_context_is_current_on_the_calling_thread() {
    refused(
        "no-cuda-context",
        &["deserializeCudaEngine", "no CUDA context is current"],
    );
}

#[test]
fn a_plan_runs_only_on_the_gpu_model_that_built_it() {
    refused(
        "plan-other-gpu",
        &["built for compute capability 9.0", "device (1) has 8.0"],
    );
}

#[test]
fn a_plan_runs_only_on_the_tensorrt_version_that_built_it() {
    let plan =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("planted-{}.plan", std::process::id()));
    let plan_arg = plan.to_str().expect("a UTF-8 path");
    let (output, text) = run("build-plan", &[plan_arg], &[]);
    assert!(output.status.success(), "{text}");
    let (output, text) = run("deserialize-plan", &[plan_arg], &[]);
    assert!(output.status.success(), "the same version runs it:\n{text}");
    let (output, text) = run(
        "deserialize-plan",
        &[plan_arg],
        &[("CELER_TRT_STANDIN_VERSION", "10.17.0")],
    );
    assert_eq!(output.status.code(), Some(3), "{text}");
    assert!(
        text.contains("built by TensorRT 10.16.0 and this is TensorRT 10.17.0"),
        "{text}"
    );
    let _ = std::fs::remove_file(&plan);
}

#[test]
fn the_runtime_outlives_its_engines() {
    aborted(
        "runtime-before-engine",
        &["IRuntime destroyed while 1 engine(s)"],
    );
}

#[test]
fn an_engine_outlives_its_contexts() {
    aborted(
        "engine-before-context",
        &["ICudaEngine `seg3` destroyed while 1 execution context(s)"],
    );
}

#[test]
fn the_parser_is_destroyed_before_its_network() {
    aborted(
        "network-before-parser",
        &["INetworkDefinition `seg3` destroyed while its ONNX parser is alive"],
    );
}

#[test]
fn the_network_is_destroyed_before_its_builder() {
    aborted(
        "builder-before-network",
        &["IBuilder destroyed while 1 network(s)"],
    );
}

#[test]
fn the_timing_cache_outlives_the_builders_that_use_it() {
    aborted(
        "cache-before-builder",
        &["ITimingCache destroyed while 1 builder(s)"],
    );
}

#[test]
fn a_context_is_not_destroyed_with_work_in_flight() {
    aborted(
        "context-with-work-in-flight",
        &["has not completed: synchronise its stream"],
    );
}

#[test]
fn what_the_stand_in_does_not_model_fails_loudly() {
    let (output, text) = run("unimplemented", &[], &[]);
    assert_eq!(output.status.signal(), Some(libc_sigabrt()), "{text}");
    assert!(
        text.contains("IRuntime::setDLACore is not implemented by the stand-in"),
        "{text}"
    );
}

#[test]
fn an_engine_is_destroyed_with_its_cuda_context_current() {
    aborted(
        "engine-on-a-thread-without-context",
        &[
            "ICudaEngine `seg3` destroyed while no CUDA context is current",
            "not the context it was deserialized in (device 0)",
            "destroyed with the context they were made in current",
        ],
    );
}

#[test]
fn an_execution_context_is_destroyed_with_its_cuda_context_current() {
    aborted(
        "context-in-another-gpus-context",
        &[
            "IExecutionContext of `seg3` destroyed while device 1's CUDA context is current",
            "not the context it was created in (device 0)",
        ],
    );
}

#[test]
fn a_builder_is_destroyed_with_its_cuda_context_current() {
    aborted(
        "builder-without-context",
        &["IBuilder destroyed while no CUDA context is current"],
    );
}

#[test]
fn objects_destroyed_on_another_thread_with_their_context_current_pass() {
    // The twin of the three above: the rule is the context, not the thread.
    let (output, text) = run("destroyed-on-a-thread-that-binds", &[], &[]);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("DONE ok"), "{text}");
    assert!(!text.contains("rule violated"), "{text}");
}

#[test]
fn an_output_of_data_dependent_shape_needs_an_output_allocator() {
    refused_on(
        "data-dependent-no-allocator",
        PROB_NONZERO,
        &[
            "SHAPE foreground 2 dims: 4 x -1",
            "enqueueV3 of `prob-nonzero`: output `foreground` has the data-dependent shape [4x-1]",
            "needs an IOutputAllocator (setOutputAllocator)",
            "FAILED enqueueV3",
        ],
    );
}

#[test]
fn an_output_of_data_dependent_shape_runs_with_an_output_allocator() {
    // The twin: the same engine, its output given an allocator, runs; the allocator hears
    // the shape ([4, 2048]) and the indices are right (the harness checks both).
    let (output, text) = run_model("data-dependent-allocator", PROB_NONZERO, &[], &[]);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("SHAPE foreground 2 dims: 4 x -1"), "{text}");
    assert!(text.contains("DONE ok"), "{text}");
    assert!(!text.contains("LOG ERROR"), "{text}");
}

/// The scenario failed at enqueueV3 with the CUDA error TensorRT's runtime logs for an
/// illegal address, and the stream's synchronisation then returned the sticky error.
fn failed_with_a_sticky_error(text: &str, output: &Output) {
    assert_eq!(output.status.code(), Some(3), "{text}");
    for word in [
        "LOG ERROR",
        "enqueueV3 of `seg3`: Error Code 1: Cuda Runtime (an illegal memory access was encountered)",
        "CUDA_ERROR_ILLEGAL_ADDRESS: the CUDA context's error is sticky",
        "FAILED enqueueV3",
        "FAILED cuStreamSynchronize",
    ] {
        assert!(text.contains(word), "no `{word}` in:\n{text}");
    }
}

#[test]
fn a_sticky_cuda_error_can_surface_inside_enqueue() {
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("fault");
    std::fs::write(&fault, "enqueue-sticky").unwrap();
    let (output, text) = run(
        "enqueue-sticky",
        &[],
        &[("CELER_TRT_STANDIN_FAULT_FILE", fault.to_str().unwrap())],
    );
    failed_with_a_sticky_error(&text, &output);
    assert!(
        text.contains("a kernel of enqueueV3 hit an illegal address (injected fault"),
        "{text}"
    );
    assert!(!fault.exists(), "the fault was taken");
}

#[test]
fn an_enqueue_into_a_sticky_context_fails() {
    // The run that discovers the loss: its thread had not been told of it yet.
    let (output, text) = run("sticky-context", &[], &[]);
    failed_with_a_sticky_error(&text, &output);
}

/// Where the relaunch rule fires, its words: the rule, and what the loss was.
const RELAUNCH: &str = "the process must be terminated and relaunched to use CUDA again";

#[test]
fn after_a_sticky_error_no_tensorrt_call_passes() {
    // The twin of the three below: the context is lost inside enqueueV3, the caller is told
    // (the enqueue fails, so does its stream's synchronisation), and it leaves every
    // TensorRT object alive without another call, for the process to be relaunched.
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("fault");
    std::fs::write(&fault, "enqueue-sticky").unwrap();
    let (output, text) = run(
        "enqueue-sticky",
        &[],
        &[("CELER_TRT_STANDIN_FAULT_FILE", fault.to_str().unwrap())],
    );
    failed_with_a_sticky_error(&text, &output);
    assert!(text.contains("DONE with failures"), "{text}");
    assert!(!text.contains("rule violated"), "{text}");
}

#[test]
fn no_enqueue_once_the_caller_knows_its_context_is_lost() {
    aborted(
        "told-then-enqueue",
        &[
            "enqueueV3 on a context of `seg3` touches device 0 after its context's error became sticky",
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            RELAUNCH,
        ],
    );
}

#[test]
fn no_deserialize_after_a_reset_of_the_context_tensorrt_works_in() {
    aborted(
        "reset-then-deserialize",
        &[
            "deserializeCudaEngine touches device 0 after its context was reset (cuDevicePrimaryCtxReset)",
            RELAUNCH,
        ],
    );
}

#[test]
fn an_engine_of_a_lost_device_is_not_destroyed() {
    aborted(
        "sticky-then-destroy",
        &[
            "ICudaEngine `seg3` destroyed: it touches device 0 after its context's error became sticky",
            RELAUNCH,
        ],
    );
}
