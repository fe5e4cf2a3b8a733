//! `celer serve --devices 0` end to end, as a user runs it: the real binary on a GPU (the
//! real one, or the stand-in driver where there is none), real U2NetP, real photos over
//! HTTP, answered with the same cut-outs as `celer serve --devices cpu` to within 1 LSB,
//! then a SIGTERM that it exits 0 on. And the device recovery of a server whose GPU
//! context fails mid-run, which needs the stand-in's fault injection.

mod common;
mod gpu_support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use image::RgbaImage;

/// A `celer serve` process and what it has logged.
struct Server {
    child: Child,
    address: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl Server {
    fn start(devices: &str, env: &[(&str, &str)]) -> Server {
        let model_dir = common::model_dir("u2netp");
        let mut command = Command::new(env!("CARGO_BIN_EXE_celer"));
        command
            .args(["serve", "--model-dir"])
            .arg(&model_dir)
            .args(["--devices", devices, "--replicas", "2"])
            .args(["--bind", "127.0.0.1", "--port", "0"])
            .args(["--health-check-interval-ms", "100"])
            .env("CELER_LOG", "info,ort=warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if devices != "cpu" {
            gpu_support::use_driver(&mut command);
        }
        let mut child = KillOnDrop(Some(command.spawn().expect("celer serve starts")));
        let stderr = child.child().stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (found, address) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("listening") {
                    if let Some(at) = line.split("address=").nth(1) {
                        let _ = found.send(at.split_whitespace().next().unwrap_or("").to_string());
                    }
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let address = address
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("celer serve did not listen: {}", log.lock().unwrap()))
            .parse()
            .expect("a socket address in the log");
        let server = Server {
            child: child.disarm(),
            address,
            log,
        };
        server.wait_ready();
        server
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(300);
        while Instant::now() < deadline {
            if let Ok(r) = blocking(reqwest::Client::new().get(self.url("/ping")).send()) {
                if r.status() == 200 {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("/ping never answered 200: {}", self.log());
    }

    /// POSTs `photo` to /invocations: the status and, on 200, the decoded cut-out.
    fn cutout(&self, photo: &Path) -> (u16, Option<RgbaImage>) {
        let body = std::fs::read(photo).expect("the photo");
        let kind = if photo.extension().is_some_and(|e| e == "png") {
            "image/png"
        } else {
            "image/jpeg"
        };
        let (status, bytes) = blocking(async {
            let response = reqwest::Client::new()
                .post(self.url("/invocations"))
                .header("Content-Type", kind)
                .body(body)
                .send()
                .await
                .expect("an answer");
            let status = response.status().as_u16();
            (status, response.bytes().await.expect("the body"))
        });
        let image = (status == 200).then(|| {
            image::load_from_memory(&bytes)
                .expect("a PNG cut-out")
                .into_rgba8()
        });
        (status, image)
    }

    fn metrics(&self) -> String {
        blocking(async {
            let response = reqwest::Client::new()
                .get(self.url("/metrics"))
                .send()
                .await
                .expect("/metrics answers");
            response.text().await.expect("metrics text")
        })
    }

    /// SIGTERM, then the exit status (within 30 s).
    fn terminate(mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill runs");
        assert!(sent.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit 30 s after SIGTERM: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Kills the child if the test fails before a `Server` owns it.
struct KillOnDrop(Option<Child>);

impl KillOnDrop {
    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("not disarmed")
    }

    fn disarm(mut self) -> Child {
        self.0.take().expect("not disarmed")
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn blocking<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

/// The largest difference of any channel of two cut-outs of the same size.
fn max_difference(a: &RgbaImage, b: &RgbaImage) -> u8 {
    assert_eq!(a.dimensions(), b.dimensions());
    a.as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}

const PHOTOS: [&str; 3] = ["astronaut.png", "photo-1920x1080.jpg", "chelsea-exif6.jpg"];

#[test]
fn serve_on_a_gpu_gives_the_cpu_cut_outs_over_http_and_stops_on_sigterm() {
    let gpu = Server::start("0", &[]);
    let cpu = Server::start("cpu", &[]);
    assert!(
        gpu.log().contains("GPU replica ready"),
        "the GPU served: {}",
        gpu.log()
    );
    for name in PHOTOS {
        let photo = common::fetched(name);
        let (status, on_gpu) = gpu.cutout(&photo);
        assert_eq!(status, 200, "{name} on the GPU: {}", gpu.log());
        let (status, on_cpu) = cpu.cutout(&photo);
        assert_eq!(status, 200, "{name} on the CPU");
        let (on_gpu, on_cpu) = (on_gpu.unwrap(), on_cpu.unwrap());
        let worst = max_difference(&on_gpu, &on_cpu);
        assert!(worst <= 1, "{name}: the GPU's cut-out differs by {worst}");
    }
    let status = gpu.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(cpu.terminate().success());
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
    let server = Server::start(
        "0",
        &[(
            "CELER_CUDA_STANDIN_FAULT_FILE",
            fault.to_str().expect("a UTF-8 path"),
        )],
    );
    let photo = common::fetched("astronaut.png");
    let (status, before) = server.cutout(&photo);
    assert_eq!(status, 200);
    std::fs::write(&fault, "sticky").unwrap();
    let (status, _) = server.cutout(&photo);
    assert!(
        status >= 500,
        "the request whose kernel faulted cannot succeed: {status}"
    );
    assert!(!fault.exists(), "the fault was taken");
    let deadline = Instant::now() + Duration::from_secs(120);
    let after = loop {
        if let (200, Some(image)) = server.cutout(&photo) {
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
    let metrics = server.metrics();
    assert!(
        metrics.contains("celer_device_recoveries_total{device=\"gpu0\"} 1"),
        "{metrics}"
    );
    let log = server.log();
    assert!(log.contains("device lost: reopening it"), "{log}");
    assert!(log.contains("device reopened and reloaded"), "{log}");
    assert!(server.terminate().success());
}
