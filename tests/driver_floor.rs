//! celer's CUDA driver floor, CUDA 12.2 (NVIDIA R535), on the stand-in CUDA driver built
//! as each driver version it can be (11.8, below the floor, then 12.2, 12.4, 12.8, 13.0):
//! each reports its version and exports only the entry points that version has; every
//! entry point celer's driver layer can resolve (`celer::cuda::driver::sys::ENTRY_POINTS`)
//! is in the floor's driver; a call of a newer entry point (planted here:
//! `cuEventElapsedTime_v2`, CUDA 12.8's) fails under the floor's driver, looked up as
//! celer's layer looks it up (through cudarc's loader); and a driver below the floor is
//! refused by the probe, with the error the README quotes, while `celer serve` stays up on
//! the CPU. The GPU suite itself runs at the floor and at 13.0 in `make test`
//! (CELER_TEST_CUDA_DRIVER).

// `unsafe` here: opens the stand-in driver and calls it directly; each block says why it is sound.
#![allow(unsafe_code)]

mod common;
mod serve_support;

use std::process::{Command, Stdio};
use std::time::Duration;

use celer_cuda_standin::{library_of, versions};

/// Set in the child process this binary starts of itself: the entry point to look up.
const CHILD: &str = "CELER_TEST_DRIVER_FLOOR_CHILD";

fn version_code(version: &str) -> i32 {
    let (major, minor) = version.split_once('.').expect("a version");
    major.parse::<i32>().unwrap() * 1000 + minor.parse::<i32>().unwrap() * 10
}

#[test]
fn each_driver_version_reports_itself_and_lacks_the_newer_entry_points() {
    assert_eq!(versions(), ["11.8", "12.2", "12.4", "12.8", "13.0"]);
    // The entry points celer's path resolves that are newer than CUDA 11.0, and since when.
    let newer = [
        ("cuMemAllocAsync", "11.2"),
        ("cuDeviceGetUuid_v2", "11.4"),
        ("cuCtxSetFlags", "12.1"),
        ("cuEventElapsedTime_v2", "12.8"),
    ];
    for version in versions() {
        let path = library_of(version).unwrap();
        // SAFETY: the stand-in's initialisers only fill its kernel tables; nothing of this
        // copy but cuDriverGetVersion is called, and it stays loaded (RTLD_LOCAL) until
        // dropped.
        let library = unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // SAFETY: cuDriverGetVersion(int*) as CUDA declares it.
        let reported = unsafe {
            let get: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> i32> =
                library.get(b"cuDriverGetVersion\0").unwrap();
            let mut code = 0;
            assert_eq!(get(&mut code), 0);
            code
        };
        assert_eq!(reported, version_code(version), "{version}");
        for (name, since) in newer {
            // SAFETY: only whether the symbol exists is read; it is never called.
            let exported = unsafe { library.get::<*const ()>(name.as_bytes()) }.is_ok();
            assert_eq!(
                exported,
                version_code(version) >= version_code(since),
                "CUDA {version}: {name} (since {since}) exported: {exported}"
            );
        }
        // What every version has, the event timing celer calls among them.
        // SAFETY: looked up, never called.
        let timing = unsafe { library.get::<*const ()>(b"cuEventElapsedTime\0") };
        assert!(timing.is_ok());
    }
}

#[test]
fn every_entry_point_of_celers_driver_layer_is_in_the_floor_driver() {
    let layer = celer::cuda::driver::sys::ENTRY_POINTS;
    assert!(layer.len() > 40, "{layer:?}");
    // None of the newer entry points planted above.
    assert!(!layer.contains(&"cuEventElapsedTime_v2"));
    for version in ["12.2", "13.0"] {
        let path = library_of(version).unwrap();
        // SAFETY: the stand-in's initialisers only fill its kernel tables; nothing of this
        // copy is called, and it stays loaded (RTLD_LOCAL) until dropped.
        let library = unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let missing: Vec<&str> = layer
            .iter()
            .copied()
            // SAFETY: only whether the symbol exists is read; it is never called.
            .filter(|name| unsafe { library.get::<*const ()>(name.as_bytes()) }.is_err())
            .collect();
        assert!(
            missing.is_empty(),
            "the CUDA {version} driver lacks entry points celer's driver layer resolves: {missing:?}"
        );
    }
}

/// Set in the child process of a_missing_entry_point_is_an_error_naming_it.
const LAYER_CHILD: &str = "CELER_TEST_DRIVER_FLOOR_LAYER_CHILD";

#[test]
fn a_missing_entry_point_is_an_error_naming_it() {
    let name = "a_missing_entry_point_is_an_error_naming_it";
    if std::env::var(LAYER_CHILD).is_ok() {
        // The stand-in of CUDA 11.8 lacks cuCtxSetFlags (12.1): celer's layer answers an
        // error naming it, where cudarc's loader would panic.
        let context = celer::cuda::driver::CudaContext::new(0).expect("a context on 11.8");
        let err = context
            .set_blocking_synchronize()
            .expect_err("no cuCtxSetFlags before 12.1");
        println!("ANSWER {err}");
        return;
    }
    let dir = library_of("11.8").unwrap().parent().unwrap().to_path_buf();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(LAYER_CHILD, "1")
        .env("LD_LIBRARY_PATH", &dir)
        .stdin(Stdio::null())
        .output()
        .expect("the test binary runs");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        said.contains(
            "ANSWER cuCtxSetFlags cannot be called: the CUDA driver does not export cuCtxSetFlags"
        ),
        "{said}"
    );
}

/// In the child: the driver on LD_LIBRARY_PATH, found as cudarc's loader finds it, and
/// `name` looked up as celer's driver layer (src/cuda/driver/sys.rs) looks up every entry
/// point on its first call (a failed lookup is then an error naming it).
fn look_up_in_child(name: &str) {
    // SAFETY: loads the driver cudarc would load (the stand-in, first on the path).
    let driver = unsafe { cudarc::driver::sys::culib() };
    // SAFETY: only the lookup; nothing is called.
    match unsafe { driver.get::<*const ()>(name.as_bytes()) } {
        Ok(_) => println!("RESOLVED {name}"),
        Err(e) => println!("MISSING {name}: {e}"),
    }
}

fn look_up(version: &str, name: &str) -> String {
    let dir = library_of(version).unwrap().parent().unwrap().to_path_buf();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_planted_call_of_a_newer_entry_point_fails_on_the_floor_driver",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, name)
        .env("LD_LIBRARY_PATH", &dir)
        .stdin(Stdio::null())
        .output()
        .expect("the test binary runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_planted_call_of_a_newer_entry_point_fails_on_the_floor_driver() {
    if let Ok(name) = std::env::var(CHILD) {
        return look_up_in_child(&name);
    }
    // CUDA 12.8's event timing (what cudarc's cuda-12080 and later bindings call): missing
    // on the floor's driver, there on 12.8 and 13.0.
    let planted = "cuEventElapsedTime_v2";
    for (version, found) in [
        ("12.2", false),
        ("12.4", false),
        ("12.8", true),
        ("13.0", true),
    ] {
        let said = look_up(version, planted);
        let expected = if found { "RESOLVED" } else { "MISSING" };
        assert!(
            said.contains(&format!("{expected} {planted}")),
            "CUDA {version}: {said}"
        );
    }
    // What celer's driver layer calls instead is there on the floor's.
    assert!(look_up("12.2", "cuEventElapsedTime").contains("RESOLVED cuEventElapsedTime"));
}

/// `celer serve ARGS` on the stand-in of CUDA 11.8 (below the floor).
fn serve_on_11_8(args: &[&str]) -> Command {
    let mut command = serve_support::Server::command(&common::model_dir("u2netp"), args, &[]);
    let dir = library_of("11.8").unwrap().parent().unwrap().to_path_buf();
    command.env("LD_LIBRARY_PATH", dir);
    command
}

#[test]
fn a_driver_below_the_floor_is_refused_by_name_and_the_cpu_serves() {
    // GPUs asked for: the start fails, saying why.
    let out = serve_on_11_8(&["--devices", "0"])
        .output()
        .expect("celer runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "the CUDA driver is version 11.8, older than celer's floor, CUDA 12.2 (NVIDIA driver R535 or newer)"
        ),
        "{stderr}"
    );
    // Let to choose: the CPU serves, and the log says why the GPU does not.
    let server = serve_support::Server::spawn(
        serve_on_11_8(&["--devices", "auto"]),
        Duration::from_secs(120),
    );
    let (status, cutout) = serve_support::cutout(&server, &common::fetched("astronaut.png"));
    assert_eq!(status, 200, "{}", server.log());
    assert!(cutout.is_some());
    let log = server.log();
    assert!(log.contains("older than celer's floor"), "{log}");
    assert!(log.contains("the CPU runs the pipeline"), "{log}");
    assert!(server.stop().success());
}
