//! Every kernel file compiles with NVRTC for every architecture celer targets (sm_75,
//! sm_80, sm_86, sm_89, sm_90), and each CUBIN defines every kernel its launchers name.
//! No GPU needed, but NVRTC is: these tests FAIL (not skip) without it, because
//! `make python` installs it (nvidia-cuda-nvrtc in scripts/requirements.txt).

use celer::cuda::kernels::{compile_all, read_cache_from, write_cache_to, FILES, TESTED_ARCHS};
use celer::cuda::nvrtc::{Arch, Nvrtc, Source};

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

#[test]
fn every_kernel_compiles_for_every_target_architecture() {
    let nvrtc = nvrtc();
    let (major, minor) = nvrtc.version().expect("NVRTC version");
    println!("NVRTC {major}.{minor} from {}", nvrtc.path());
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
            "NVRTC {major}.{minor} cannot target {arch}"
        );
        let t = std::time::Instant::now();
        let cubins = compile_all(nvrtc, arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cubins.files.len(), FILES.len());
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
fn the_disk_cache_gives_back_what_was_compiled() {
    let dir = tempfile::tempdir().unwrap();
    let arch = Arch::new(8, 6);
    assert!(read_cache_from(dir.path(), arch).is_none(), "empty cache");
    let cubins = compile_all(nvrtc(), arch).unwrap();
    write_cache_to(dir.path(), &cubins).unwrap();
    let read = read_cache_from(dir.path(), arch).expect("cached");
    assert_eq!(read.files, cubins.files);
    // Another architecture is not served from this one's files.
    assert!(read_cache_from(dir.path(), Arch::new(9, 0)).is_none());
}
