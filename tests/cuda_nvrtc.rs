//! Every kernel file compiles with each NVRTC celer uses (13, and 12.2 for drivers from
//! celer's floor up) for every architecture celer targets (sm_75, sm_80, sm_86, sm_89,
//! sm_90), and each CUBIN defines every kernel its launchers name; a driver gets the
//! newest NVRTC, and the cached CUBINs, not newer than itself. No GPU needed, but both
//! NVRTCs are: these tests FAIL (not skip) without them, because `make python` installs
//! them (nvidia-cuda-nvrtc and nvidia-cuda-nvrtc-cu12 in scripts/requirements.txt).

use celer::cuda::kernels::{compile_all, read_cache_from, write_cache_to, FILES, TESTED_ARCHS};
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
