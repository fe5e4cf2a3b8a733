//! Engine manifests: the `manifest.json` that `celer build` writes next to each plan,
//! recording what the plan is only valid for (the GPU model, the TensorRT version, the
//! ONNX file's bytes) and how it was built; and the check that refuses a plan that does
//! not fit, naming the `celer build` command that makes one that does. Where engines
//! live: `<model dir>/engines/<model>/<gpu key>/<model>.plan`.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use crate::cuda::GpuIdentity;
pub use crate::host::atomic_write::write_atomically;
use crate::tensorrt::{InputProfile, Precision, TensorDesc, TrtVersion};

/// The folder, inside a model directory, that holds the engines.
pub const ENGINES_DIR: &str = "engines";
/// The manifest's file name, next to its plan.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Bumped when a field changes meaning; a manifest of another format is refused.
pub const MANIFEST_FORMAT: u32 = 1;

/// What `celer build` did, for the record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuildRecord {
    pub celer_version: String,
    /// Seconds since the Unix epoch.
    pub built_at_unix_s: u64,
    pub build_seconds: f64,
    pub workspace_mib: Option<u64>,
    /// The timing cache used and updated, relative to the engines folder.
    pub timing_cache: Option<String>,
    /// TensorRT's library file.
    pub tensorrt_library: String,
}

/// Everything a server needs to decide whether a plan may be loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineManifest {
    pub format: u32,
    /// The model's name (its ONNX file's stem), also the engine folder's name.
    pub model: String,
    /// The ONNX file, relative to the model directory.
    pub onnx_file: String,
    pub onnx_sha256: String,
    /// The plan's file name, next to the manifest.
    pub plan_file: String,
    pub plan_sha256: String,
    pub plan_bytes: u64,
    pub tensorrt_version: TrtVersion,
    /// The CUDA version of the driver that built it.
    pub cuda_driver_version: Option<String>,
    pub gpu: GpuIdentity,
    pub precision: Precision,
    /// The optimisation profile; empty when every input is static.
    pub profile: Vec<InputProfile>,
    pub inputs: Vec<TensorDesc>,
    pub outputs: Vec<TensorDesc>,
    pub build: BuildRecord,
}

/// Why an engine cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EngineCheckError {
    #[error("no engine for {model} on {gpu} ({}): {reason}; build one with `{command}`", manifest.display())]
    Missing {
        model: String,
        gpu: String,
        manifest: PathBuf,
        reason: String,
        command: String,
    },
    #[error("the engine {} does not fit this machine: {}; rebuild it with `{command}`", plan.display(), reasons.join("; "))]
    Mismatch {
        plan: PathBuf,
        reasons: Vec<String>,
        command: String,
    },
    #[error("cannot read {}: {reason}", path.display())]
    Io { path: PathBuf, reason: String },
}

/// What the running process offers, for [`EngineManifest::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequirements {
    pub gpu: GpuIdentity,
    pub tensorrt_version: TrtVersion,
    /// sha256 of the ONNX file the pipeline names now.
    pub onnx_sha256: String,
}

/// A plan that passed the check.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedEngine {
    pub plan: PathBuf,
    pub manifest: EngineManifest,
}

impl EngineManifest {
    pub fn read(path: &Path) -> Result<Self, EngineCheckError> {
        let io = |reason: String| EngineCheckError::Io {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| io(e.to_string()))?;
        Self::parse(&text).map_err(|e| io(format!("not an engine manifest: {e}")))
    }

    /// A manifest from its JSON text (what `read` does after reading the file).
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        write_atomically(path, format!("{text}\n").as_bytes())
    }

    /// Every way in which this manifest's plan cannot run with `have`, in words; empty
    /// when it fits. TensorRT refuses a plan from another version (even a patch
    /// release) and picks kernels for one GPU model, so both must match exactly.
    pub fn mismatches(&self, have: &EngineRequirements) -> Vec<String> {
        let mut reasons = Vec::new();
        if self.format != MANIFEST_FORMAT {
            reasons.push(format!(
                "manifest format {} (this celer reads format {MANIFEST_FORMAT})",
                self.format
            ));
        }
        if self.gpu != have.gpu {
            reasons.push(format!(
                "built for {} (compute capability {}), this GPU is {} (compute capability {})",
                self.gpu.name,
                self.gpu.compute_capability,
                have.gpu.name,
                have.gpu.compute_capability
            ));
        }
        if self.tensorrt_version != have.tensorrt_version {
            reasons.push(format!(
                "built with TensorRT {}, this is TensorRT {}",
                self.tensorrt_version, have.tensorrt_version
            ));
        }
        if !self.onnx_sha256.eq_ignore_ascii_case(&have.onnx_sha256) {
            reasons.push(format!(
                "built from another {} (sha256 {}, the file now has {})",
                self.onnx_file,
                short(&self.onnx_sha256),
                short(&have.onnx_sha256)
            ));
        }
        reasons
    }

    /// Ok when the plan may be loaded with `have`; otherwise every reason, and the
    /// command that rebuilds it.
    pub fn check(
        &self,
        plan: &Path,
        have: &EngineRequirements,
        model_dir: &Path,
    ) -> Result<(), EngineCheckError> {
        let reasons = self.mismatches(have);
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(EngineCheckError::Mismatch {
                plan: plan.to_path_buf(),
                reasons,
                command: build_command(model_dir),
            })
        }
    }
}

/// The folder of `model`'s engine for `gpu`.
pub fn engine_dir(engines: &Path, model: &str, gpu: &GpuIdentity) -> PathBuf {
    engines.join(model).join(gpu.key())
}

/// A model's name: its ONNX file's stem.
pub fn model_name(onnx: &Path) -> String {
    onnx.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// The command that builds a model directory's engines.
pub fn build_command(model_dir: &Path) -> String {
    format!("celer build --model-dir {}", model_dir.display())
}

/// Finds the engine of `onnx` (a model of the pipeline in `model_dir`) for `have.gpu`
/// and checks its manifest and plan. This is what serving from engines calls for each
/// model on each device before deserialising anything.
pub fn find_engine(
    model_dir: &Path,
    onnx: &Path,
    have: &EngineRequirements,
) -> Result<CheckedEngine, EngineCheckError> {
    find_engine_in(model_dir, &model_dir.join(ENGINES_DIR), onnx, have)
}

/// [`find_engine`] with the engines in `engines` instead of `<model_dir>/engines`.
pub fn find_engine_in(
    model_dir: &Path,
    engines: &Path,
    onnx: &Path,
    have: &EngineRequirements,
) -> Result<CheckedEngine, EngineCheckError> {
    let model = model_name(onnx);
    let dir = engine_dir(engines, &model, &have.gpu);
    let manifest_path = dir.join(MANIFEST_FILE);
    if !manifest_path.is_file() {
        return Err(EngineCheckError::Missing {
            model,
            gpu: format!(
                "{} (compute capability {})",
                have.gpu.name, have.gpu.compute_capability
            ),
            manifest: manifest_path,
            reason: "no manifest".into(),
            command: build_command(model_dir),
        });
    }
    let manifest = EngineManifest::read(&manifest_path)?;
    let plan = dir.join(&manifest.plan_file);
    manifest.check(&plan, have, model_dir)?;
    let plan_sha = sha256_file(&plan).map_err(|e| EngineCheckError::Missing {
        model: model.clone(),
        gpu: have.gpu.name.clone(),
        manifest: manifest_path.clone(),
        reason: format!("its plan {} cannot be read: {e}", plan.display()),
        command: build_command(model_dir),
    })?;
    if !plan_sha.eq_ignore_ascii_case(&manifest.plan_sha256) {
        return Err(EngineCheckError::Mismatch {
            plan,
            reasons: vec![format!(
                "the plan's sha256 is {}, the manifest recorded {} (a partial copy?)",
                short(&plan_sha),
                short(&manifest.plan_sha256)
            )],
            command: build_command(model_dir),
        });
    }
    Ok(CheckedEngine { plan, manifest })
}

/// Every engine manifest under `engines` (`<model>/<gpu key>/manifest.json`), sorted.
pub fn list_manifests(engines: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(models) = std::fs::read_dir(engines) else {
        return found;
    };
    for model in models.flatten() {
        let Ok(gpus) = std::fs::read_dir(model.path()) else {
            continue;
        };
        for gpu in gpus.flatten() {
            let manifest = gpu.path().join(MANIFEST_FILE);
            if manifest.is_file() {
                found.push(manifest);
            }
        }
    }
    found.sort();
    found
}

/// The sha256 of a file, lowercase hex, read in chunks (ONNX files reach gigabytes).
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

pub fn sha256_bytes(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The first 12 hex digits of a sha256, for messages.
pub fn short(sha: &str) -> &str {
    sha.get(..12).unwrap_or(sha)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensorrt::DataType;

    fn h200() -> GpuIdentity {
        GpuIdentity {
            name: "NVIDIA H200".into(),
            compute_capability: "9.0".into(),
        }
    }

    fn manifest(onnx_sha256: &str, plan: &[u8]) -> EngineManifest {
        EngineManifest {
            format: MANIFEST_FORMAT,
            model: "u2netp".into(),
            onnx_file: "u2netp.onnx".into(),
            onnx_sha256: onnx_sha256.into(),
            plan_file: "u2netp.plan".into(),
            plan_sha256: sha256_bytes(plan),
            plan_bytes: plan.len() as u64,
            tensorrt_version: "10.16.0".parse().unwrap(),
            cuda_driver_version: Some("12.8".into()),
            gpu: h200(),
            precision: Precision::Fp16,
            profile: vec![],
            inputs: vec![TensorDesc {
                name: "input.1".into(),
                is_input: true,
                data_type: DataType::Float,
                shape: vec![1, 3, 320, 320],
            }],
            outputs: vec![],
            build: BuildRecord {
                celer_version: "0.1.0".into(),
                built_at_unix_s: 1,
                build_seconds: 2.5,
                workspace_mib: Some(1024),
                timing_cache: None,
                tensorrt_library: "/usr/lib/libnvinfer.so.10".into(),
            },
        }
    }

    fn have(onnx_sha256: &str) -> EngineRequirements {
        EngineRequirements {
            gpu: h200(),
            tensorrt_version: "10.16.0".parse().unwrap(),
            onnx_sha256: onnx_sha256.into(),
        }
    }

    /// A model directory with an ONNX file and, if `plan` is given, its built engine.
    fn model_dir(plan: Option<&[u8]>) -> (tempfile::TempDir, PathBuf, String) {
        let dir = tempfile::tempdir().unwrap();
        let onnx = dir.path().join("u2netp.onnx");
        std::fs::write(&onnx, b"not really onnx").unwrap();
        let sha = sha256_file(&onnx).unwrap();
        if let Some(plan) = plan {
            let engine = engine_dir(&dir.path().join(ENGINES_DIR), "u2netp", &h200());
            write_atomically(&engine.join("u2netp.plan"), plan).unwrap();
            manifest(&sha, plan)
                .write(&engine.join(MANIFEST_FILE))
                .unwrap();
        }
        (dir, onnx, sha)
    }

    #[test]
    fn gpu_key_is_a_folder_name() {
        assert_eq!(h200().key(), "nvidia-h200-sm90");
        let odd = GpuIdentity {
            name: " Tesla T4 / (PCIe) ".into(),
            compute_capability: "7.5".into(),
        };
        assert_eq!(odd.key(), "tesla-t4-pcie-sm75");
    }

    #[test]
    fn sha256_matches_the_known_digest() {
        assert_eq!(
            sha256_bytes(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn manifest_round_trips_through_json() {
        let m = manifest("ab", b"plan");
        let text = serde_json::to_string(&m).unwrap();
        assert!(text.contains("\"tensorrt_version\":\"10.16.0\""), "{text}");
        assert!(text.contains("\"precision\":\"fp16\""), "{text}");
        assert_eq!(serde_json::from_str::<EngineManifest>(&text).unwrap(), m);
    }

    #[test]
    fn matching_engine_is_found() {
        let (dir, onnx, sha) = model_dir(Some(b"plan bytes"));
        let found = find_engine(dir.path(), &onnx, &have(&sha)).unwrap();
        assert!(found
            .plan
            .ends_with("engines/u2netp/nvidia-h200-sm90/u2netp.plan"));
        assert_eq!(found.manifest.model, "u2netp");
    }

    #[test]
    fn other_gpu_has_no_engine_and_is_told_the_build_command() {
        let (dir, onnx, sha) = model_dir(Some(b"plan bytes"));
        let mut l4 = have(&sha);
        l4.gpu = GpuIdentity {
            name: "NVIDIA L4".into(),
            compute_capability: "8.9".into(),
        };
        let msg = find_engine(dir.path(), &onnx, &l4).unwrap_err().to_string();
        assert!(msg.contains("NVIDIA L4"), "{msg}");
        assert!(
            msg.contains(&format!("celer build --model-dir {}", dir.path().display())),
            "{msg}"
        );
    }

    #[test]
    fn engine_copied_to_another_gpu_is_refused() {
        // A manifest in the H200 folder, read on a machine whose GPU has the same name
        // but another compute capability (e.g. a MIG or a misnamed copy).
        let m = manifest("ab", b"p");
        let mut have = have("ab");
        have.gpu.compute_capability = "8.0".into();
        let reasons = m.mismatches(&have);
        assert_eq!(reasons.len(), 1, "{reasons:?}");
        assert!(reasons[0].contains("compute capability 9.0"), "{reasons:?}");
        assert!(reasons[0].contains("compute capability 8.0"), "{reasons:?}");
    }

    #[test]
    fn other_tensorrt_version_is_refused_with_both_versions() {
        let (dir, onnx, sha) = model_dir(Some(b"plan bytes"));
        let mut newer = have(&sha);
        newer.tensorrt_version = "10.16.1".parse().unwrap();
        let msg = find_engine(dir.path(), &onnx, &newer)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("TensorRT 10.16.0"), "{msg}");
        assert!(msg.contains("TensorRT 10.16.1"), "{msg}");
        assert!(
            msg.contains("rebuild it with `celer build --model-dir"),
            "{msg}"
        );
    }

    #[test]
    fn changed_onnx_file_is_refused() {
        let (dir, onnx, _) = model_dir(Some(b"plan bytes"));
        std::fs::write(&onnx, b"a retrained model").unwrap();
        let sha = sha256_file(&onnx).unwrap();
        let msg = find_engine(dir.path(), &onnx, &have(&sha))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("built from another u2netp.onnx"), "{msg}");
    }

    #[test]
    fn every_mismatch_is_listed() {
        let m = manifest("ab", b"p");
        let other = EngineRequirements {
            gpu: GpuIdentity {
                name: "NVIDIA A10G".into(),
                compute_capability: "8.6".into(),
            },
            tensorrt_version: "11.1.0".parse().unwrap(),
            onnx_sha256: "cd".into(),
        };
        assert_eq!(m.mismatches(&other).len(), 3);
        assert!(
            m.mismatches(&have("AB")).is_empty(),
            "sha256 compares case-insensitively"
        );
    }

    #[test]
    fn truncated_plan_is_refused() {
        let (dir, onnx, sha) = model_dir(Some(b"plan bytes"));
        let plan = engine_dir(&dir.path().join(ENGINES_DIR), "u2netp", &h200()).join("u2netp.plan");
        std::fs::write(&plan, b"plan").unwrap();
        let msg = find_engine(dir.path(), &onnx, &have(&sha))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("partial copy"), "{msg}");
    }

    #[test]
    fn missing_engine_names_the_command() {
        let (dir, onnx, sha) = model_dir(None);
        let err = find_engine(dir.path(), &onnx, &have(&sha)).unwrap_err();
        assert!(matches!(err, EngineCheckError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("celer build --model-dir"), "{err}");
        assert!(list_manifests(&dir.path().join(ENGINES_DIR)).is_empty());
    }

    #[test]
    fn manifests_are_listed() {
        let (dir, _, _) = model_dir(Some(b"plan"));
        let found = list_manifests(&dir.path().join(ENGINES_DIR));
        assert_eq!(found.len(), 1);
        assert!(found[0].ends_with("u2netp/nvidia-h200-sm90/manifest.json"));
    }
}
