//! Kernels shipped ahead of time, as the GPU image ships them: `celer kernels --out DIR
//! --arch sm_90` (the real binary, with the checkout's NVRTCs, 13 and 12.2) writes one
//! CUBIN per kernel file and NVRTC; then a process with NVRTC hidden (`CELER_NVRTC_PATH=/nonexistent`) and
//! `CELER_KERNEL_DIR=DIR` gets them from the kernel loader (`cubins_for`, what every GPU
//! replica calls) without compiling or writing its cache, those of NVRTC 12.2 for a CUDA
//! 12.2 driver and NVRTC 13's for a CUDA 13 one. The same process with an empty
//! folder fails for want of NVRTC, so the load can only have come from the folder. A GPU
//! of a higher minor revision of the same major is served the folder's code. No GPU
//! needed; NVRTC is (`make python`), and its absence fails the test.

use std::path::Path;
use std::process::{Command, Output};

use celer::cuda::kernels::{
    cache_file_name, cubins_for, read_cache_from, read_compatible_from, FILES,
};
use celer::cuda::nvrtc::Nvrtc;
use celer::cuda::Arch;
use celer::cuda::{CudaVersion, DRIVER_FLOOR};

/// Set in the child process this test starts of itself (see `loader_child`): the CUDA
/// version of the driver it loads kernels for.
const CHILD: &str = "CELER_TEST_KERNELS_CHILD";
const SM_90: Arch = Arch::new(9, 0);

fn celer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_celer"))
        .args(args)
        // The checkout's .venv holds NVRTC; the binary finds it from here.
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("CELER_NVRTC_PATH")
        .env("CELER_LOG", "warn")
        .output()
        .expect("the celer binary runs")
}

fn text(output: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// This test binary again, running only this test in child mode for a `driver`, with
/// NVRTC hidden, `CELER_KERNEL_DIR=shipped` and an empty writable cache `cache`.
fn loader_child(shipped: &Path, cache: &Path, driver: CudaVersion) -> Output {
    Command::new(std::env::current_exe().expect("the test binary's path"))
        .args([
            "shipped_kernels_load_without_nvrtc",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, driver.to_string())
        .env("CELER_NVRTC_PATH", "/nonexistent/libnvrtc.so")
        .env("CELER_KERNEL_DIR", shipped)
        .env("CELER_KERNEL_CACHE", cache)
        .output()
        .expect("the test binary runs")
}

/// The child's side: the loader, as a GPU replica calls it.
fn load_in_child(driver: &str) {
    let (major, minor) = driver.split_once('.').expect("a version");
    let driver = CudaVersion::new(major.parse().unwrap(), minor.parse().unwrap());
    let cubins =
        cubins_for(SM_90, driver).unwrap_or_else(|e| panic!("cubins_for(sm_90, {driver}): {e}"));
    let dir = std::env::var_os("CELER_KERNEL_DIR").expect("CELER_KERNEL_DIR is set");
    let on_disk = read_cache_from(Path::new(&dir), SM_90, driver).expect("the shipped files");
    assert!(
        cubins.files == on_disk.files,
        "the loaded bytes differ from the shipped files"
    );
    println!(
        "LOADED {} files for {} from NVRTC {}",
        cubins.files.len(),
        cubins.arch,
        cubins.nvrtc
    );
}

#[test]
fn shipped_kernels_load_without_nvrtc() {
    if let Ok(driver) = std::env::var(CHILD) {
        return load_in_child(&driver);
    }
    let nvrtcs: Vec<CudaVersion> = Nvrtc::all()
        .unwrap_or_else(|e| panic!("NVRTC comes from `make python`: {e}"))
        .iter()
        .map(Nvrtc::version)
        .collect();
    assert!(
        nvrtcs.contains(&DRIVER_FLOOR),
        "NVRTC {DRIVER_FLOOR} (`make python`): {nvrtcs:?}"
    );
    let shipped = tempfile::tempdir().unwrap();
    let out = celer(&[
        "kernels",
        "--out",
        shipped.path().to_str().unwrap(),
        "--arch",
        "sm_90",
    ]);
    assert!(
        out.status.success(),
        "celer kernels failed (NVRTC comes from `make python`):\n{}",
        text(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("sm_90: {} files", FILES.len())),
        "{}",
        text(&out)
    );
    // Exactly one file per kernel file and NVRTC, named as the loader looks for them, each
    // an ELF.
    let mut written: Vec<String> = std::fs::read_dir(shipped.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    let mut expected: Vec<String> = nvrtcs
        .iter()
        .flat_map(|&nvrtc| {
            FILES
                .iter()
                .map(move |f| cache_file_name(SM_90, nvrtc, f.name))
        })
        .collect();
    expected.sort();
    assert_eq!(written, expected);
    for name in &written {
        let bytes = std::fs::read(shipped.path().join(name)).unwrap();
        assert_eq!(&bytes[..4], b"\x7fELF", "{name} is not a CUBIN");
    }

    // A GPU of the same major and a higher minor revision runs them; another major not.
    let newest = nvrtcs[0];
    let newer =
        read_compatible_from(shipped.path(), Arch::new(9, 1), newest).expect("sm_91 runs sm_90");
    assert_eq!(newer.arch, SM_90);
    for other in [Arch::new(8, 9), Arch::new(10, 0)] {
        assert!(
            read_compatible_from(shipped.path(), other, newest).is_none(),
            "{other} given sm_90 code"
        );
    }

    // Shipped: loaded with NVRTC hidden, and nothing compiled into the writable cache; a
    // driver gets the files of the newest NVRTC not newer than itself.
    let cache = tempfile::tempdir().unwrap();
    for (driver, nvrtc) in [(DRIVER_FLOOR, DRIVER_FLOOR), (newest, newest)] {
        let child = loader_child(shipped.path(), cache.path(), driver);
        assert!(child.status.success(), "{}", text(&child));
        let loaded = format!("LOADED {} files for sm_90 from NVRTC {nvrtc}", FILES.len());
        assert!(
            String::from_utf8_lossy(&child.stdout).contains(&loaded),
            "a CUDA {driver} driver: {}",
            text(&child)
        );
    }
    assert_eq!(
        std::fs::read_dir(cache.path()).unwrap().count(),
        0,
        "the loader wrote to its cache, so it compiled"
    );

    // Not shipped (an empty folder): the same loader needs NVRTC, which is hidden.
    let empty = tempfile::tempdir().unwrap();
    let child = loader_child(empty.path(), cache.path(), newest);
    assert!(
        !child.status.success(),
        "loaded without kernels or NVRTC:\n{}",
        text(&child)
    );
    assert!(
        text(&child).contains("libnvrtc not found"),
        "{}",
        text(&child)
    );
}

#[test]
fn an_architecture_nvrtc_cannot_target_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = celer(&[
        "kernels",
        "--out",
        dir.path().to_str().unwrap(),
        "--arch",
        "sm_90,sm_20",
    ]);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot compile for sm_20"),
        "{}",
        text(&out)
    );
    assert!(
        stderr.contains("sm_90"),
        "the supported list: {}",
        text(&out)
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
