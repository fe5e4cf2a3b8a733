//! `celer serve --devices 0` end to end, as a user runs it: the real binary on a GPU (the
//! real one, or the stand-in driver where there is none), real U2NetP, real photos over
//! HTTP, answered with the same cut-outs as `celer serve --devices cpu` to within 1 LSB,
//! then a SIGTERM that it exits 0 on. And the device recovery of a server whose GPU
//! context fails mid-run, which needs the stand-in's fault injection.

mod common;
mod gpu_support;
mod serve_support;

use std::time::{Duration, Instant};

use serve_support::{cutout, max_difference, Server};

/// `celer serve --devices DEVICES` on U2NetP with two replicas, on the tests' CUDA driver
/// (the stand-in where there is no GPU), waited for until `/ping` answers 200.
fn serve(devices: &str, env: &[(&str, &str)]) -> Server {
    serve_replicas(devices, "2", env)
}

fn serve_replicas(devices: &str, replicas: &str, env: &[(&str, &str)]) -> Server {
    let mut command = Server::command(
        &common::model_dir("u2netp"),
        [
            "--devices",
            devices,
            "--replicas",
            replicas,
            "--health-check-interval-ms",
            "100",
        ],
        env,
    );
    if devices != "cpu" {
        gpu_support::use_driver(&mut command);
    }
    // Loading on the stand-in (kernels compiled, run as host code) takes a while.
    Server::spawn(command, Duration::from_secs(300))
}

const PHOTOS: [&str; 3] = ["astronaut.png", "photo-1920x1080.jpg", "chelsea-exif6.jpg"];

#[test]
fn serve_on_a_gpu_gives_the_cpu_cut_outs_over_http_and_stops_on_sigterm() {
    let gpu = serve("0", &[]);
    let cpu = serve("cpu", &[]);
    assert!(
        gpu.log().contains("GPU replica ready"),
        "the GPU served: {}",
        gpu.log()
    );
    for name in PHOTOS {
        let photo = common::fetched(name);
        let (status, on_gpu) = cutout(&gpu, &photo);
        assert_eq!(status, 200, "{name} on the GPU: {}", gpu.log());
        let (status, on_cpu) = cutout(&cpu, &photo);
        assert_eq!(status, 200, "{name} on the CPU");
        let (on_gpu, on_cpu) = (on_gpu.unwrap(), on_cpu.unwrap());
        let worst = max_difference(&on_gpu, &on_cpu);
        assert!(worst <= 1, "{name}: the GPU's cut-out differs by {worst}");
    }
    let status = gpu.stop();
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(cpu.stop().success());
}

/// The stand-in fails a launch of the running server (its fault file): the request that
/// ran it fails, the GPU is reopened, and the server answers again with the same cut-out,
/// without a restart.
#[test]
fn a_served_gpu_recovers_from_a_lost_context_without_a_restart() {
    if gpu_support::driver().standin().is_none() {
        panic!("this test arms the stand-in's fault injection: run it where the stand-in is the driver (CELER_TEST_CUDA=standin)");
    }
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("fault");
    let server = serve(
        "0",
        &[(
            "CELER_CUDA_STANDIN_FAULT_FILE",
            fault.to_str().expect("a UTF-8 path"),
        )],
    );
    let photo = common::fetched("astronaut.png");
    let (status, before) = cutout(&server, &photo);
    assert_eq!(status, 200);
    std::fs::write(&fault, "sticky").unwrap();
    let (status, _) = cutout(&server, &photo);
    assert!(
        status >= 500,
        "the request whose kernel faulted cannot succeed: {status}"
    );
    assert!(!fault.exists(), "the fault was taken");
    let deadline = Instant::now() + Duration::from_secs(120);
    let after = loop {
        if let (200, Some(image)) = cutout(&server, &photo) {
            break image;
        }
        assert!(
            Instant::now() < deadline,
            "the GPU did not come back: {}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        after,
        before.unwrap(),
        "the same cut-out after the recovery"
    );
    let metrics = String::from_utf8(server.get("/metrics").1).expect("metrics text");
    assert!(
        metrics.contains("celer_device_recoveries_total{device=\"gpu0\"} 1"),
        "{metrics}"
    );
    let log = server.log();
    assert!(log.contains("device lost: reopening it"), "{log}");
    assert!(log.contains("device reopened and reloaded"), "{log}");
    assert!(server.stop().success());
}

/// Every device buffer a request wrote is poisoned (the stand-in's poison file) before the
/// next request of the same size on the same replica starts: the answers stay the same
/// to the bit, so no stage reads what the last request left in a buffer it reuses (the
/// resize tables, written when a size is first served and kept for it, are not rewritten
/// by the second request, and so are not poisoned).
#[test]
fn a_served_gpu_answers_the_same_with_every_buffer_it_wrote_poisoned_between_requests() {
    if gpu_support::driver().standin().is_none() {
        panic!("this test poisons device memory through the stand-in's poison file: run it where the stand-in is the driver (CELER_TEST_CUDA=standin)");
    }
    let dir = tempfile::tempdir().unwrap();
    let poison = dir.path().join("poison");
    // One replica: both requests reuse its buffers.
    let server = serve_replicas(
        "0",
        "1",
        &[(
            "CELER_CUDA_STANDIN_POISON_FILE",
            poison.to_str().expect("a UTF-8 path"),
        )],
    );
    let photo = common::fetched("photo-1920x1080.jpg");
    let (status, first) = cutout(&server, &photo);
    assert_eq!(status, 200, "{}", server.log());
    // Writes are tracked from the second request's first call on...
    std::fs::write(&poison, "mark").unwrap();
    let (status, second) = cutout(&server, &photo);
    assert_eq!(status, 200, "{}", server.log());
    assert!(!poison.exists(), "the stand-in took the mark");
    // ... and everything it wrote is poisoned before the third touches anything.
    std::fs::write(&poison, "poison").unwrap();
    let (status, third) = cutout(&server, &photo);
    assert_eq!(status, 200, "{}", server.log());
    assert!(!poison.exists(), "the stand-in poisoned");
    let log = server.log();
    let poisoned = log
        .lines()
        .find_map(|l| l.split("cuda stand-in: poisoned ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("the stand-in did not say what it poisoned: {log}"));
    assert!(poisoned > 0, "nothing was poisoned: {log}");
    let first = first.unwrap();
    assert!(second.as_ref() == Some(&first), "the second answer differs");
    assert!(
        third.as_ref() == Some(&first),
        "the answer after poisoning differs: a stage read a buffer before writing it"
    );
    assert!(server.stop().success());
}
