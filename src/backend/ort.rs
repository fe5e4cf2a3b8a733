//! ONNX Runtime through the `ort` crate, loaded at run time (`load-dynamic`). This module
//! finds the shared library, creates the one process-wide environment, and wraps one
//! session per model per replica. It knows nothing of images: inputs are NCHW f32.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use ort::value::TensorRef;

use super::{BackendError, Tensor};

/// Where to look for the library when `ORT_DYLIB_PATH` is unset: the project's own
/// virtual environment, which `make python` fills from the pinned onnxruntime wheel.
const VENV_CAPI: &str = "site-packages/onnxruntime/capi";

/// The shared library to load: `ORT_DYLIB_PATH`, else the `.venv` of the checkout that
/// holds the working directory or the executable.
pub fn library_path() -> Result<PathBuf, BackendError> {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(BackendError::LibraryMissing(format!(
                "ORT_DYLIB_PATH={} is not a file; point it at libonnxruntime.so, or unset it and run `make python`",
                path.display()
            )))
        };
    }
    venvs().find_map(|venv| find_in_venv(&venv)).ok_or_else(|| {
        BackendError::LibraryMissing(
            "set ORT_DYLIB_PATH to libonnxruntime.so (from the onnxruntime wheel, e.g. \
                 .venv/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime.so.1.31.1), \
                 or run `make python` in the celer checkout to install it"
                .into(),
        )
    })
}

/// The `.venv` folders where `make python` may have installed the wheels celer loads:
/// one in each folder above the working directory, then above the executable.
pub fn venvs() -> impl Iterator<Item = PathBuf> {
    let cwd = std::env::current_dir().ok();
    let exe = std::env::current_exe().ok();
    let above_cwd: Vec<PathBuf> = cwd
        .iter()
        .flat_map(|d| d.ancestors().map(Path::to_path_buf))
        .collect();
    let above_exe: Vec<PathBuf> = exe
        .iter()
        .flat_map(|e| e.ancestors().skip(1).map(Path::to_path_buf))
        .collect();
    above_cwd
        .into_iter()
        .chain(above_exe)
        .map(|root| root.join(".venv"))
}

fn find_in_venv(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(&lib)
        .ok()?
        .flatten()
        .map(|python| python.path().join(VENV_CAPI))
        .filter_map(|capi| std::fs::read_dir(capi).ok())
        .flat_map(|dir| dir.flatten().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libonnxruntime.so"))
        })
        .collect();
    // The versioned file is the real library; `libonnxruntime.so` may be absent.
    candidates.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    candidates.into_iter().next()
}

/// The process-wide ONNX Runtime environment. `ort` allows one per process, and loading
/// the library twice is an error, so the first call decides and later calls share it.
pub fn environment() -> Result<&'static ort::environment::Environment, BackendError> {
    static ENV: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();
    ENV.get_or_init(|| {
        let path = library_path().map_err(|e| e.to_string())?;
        tracing::info!(library = %path.display(), "loading ONNX Runtime");
        ort::init_from(&path)
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?
            .with_name("celer")
            .build()
            .map_err(|e| format!("cannot create the ONNX Runtime environment: {e}"))
    })
    .as_ref()
    .map_err(|e| BackendError::LibraryMissing(e.clone()))
}

/// A tensor's name, element type and shape (-1 for a dynamic dimension).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorDescription {
    pub name: String,
    pub element_type: String,
    pub shape: Vec<i64>,
}

/// One ONNX model loaded into one session. Not shared: each replica loads its own, so
/// `run` needs no lock.
pub struct OrtModel {
    session: Session,
    label: String,
}

impl OrtModel {
    /// Loads `path` with `intra_threads` threads for ONNX Runtime's operators.
    pub fn load(path: &Path, intra_threads: usize) -> Result<Self, BackendError> {
        let label = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let load_err = |reason: String| BackendError::Load {
            model: path.display().to_string(),
            reason,
        };
        let env = environment()?;
        let session = Session::builder(env)
            .map_err(|e| load_err(e.to_string()))?
            .with_optimization_level(GraphOptimizationLevel::Level3)
            .map_err(|e| load_err(e.to_string()))?
            .with_intra_threads(intra_threads.max(1))
            .map_err(|e| load_err(e.to_string()))?
            .with_inter_threads(1)
            .map_err(|e| load_err(e.to_string()))?
            // Spinning threads burn the cores that the other replicas and the pre/post
            // stages need; a replica's threads sleep between requests.
            .with_intra_op_spinning(false)
            .map_err(|e| load_err(e.to_string()))?
            .commit_from_file(path)
            .map_err(|e| load_err(e.to_string()))?;
        Ok(Self { session, label })
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn inputs(&self) -> Vec<TensorDescription> {
        self.session.inputs().iter().map(describe).collect()
    }

    pub fn outputs(&self) -> Vec<TensorDescription> {
        self.session.outputs().iter().map(describe).collect()
    }

    /// Runs the model on NCHW f32 inputs and returns the named output.
    pub fn run(
        &mut self,
        inputs: &[(&str, [usize; 4], &[f32])],
        output: &str,
    ) -> Result<Tensor, BackendError> {
        let run_err = |reason: String| BackendError::Run {
            model: self.label.clone(),
            reason,
        };
        let mut values = Vec::with_capacity(inputs.len());
        for (name, shape, data) in inputs {
            let tensor = TensorRef::from_array_view((*shape, *data))
                .map_err(|e| run_err(format!("input `{name}`: {e}")))?;
            values.push((*name, tensor));
        }
        let outputs = self
            .session
            .run(values)
            .map_err(|e| run_err(e.to_string()))?;
        let value = outputs
            .get(output)
            .ok_or_else(|| run_err(format!("no output named `{output}`")))?;
        let (shape, data) = value
            .try_extract_tensor::<f32>()
            .map_err(|e| run_err(format!("output `{output}`: {e}")))?;
        Ok(Tensor {
            shape: shape.iter().map(|d| (*d).max(0) as usize).collect(),
            data: data.to_vec(),
        })
    }
}

fn describe(outlet: &ort::value::Outlet) -> TensorDescription {
    let dtype = outlet.dtype();
    TensorDescription {
        name: outlet.name().to_string(),
        element_type: dtype
            .tensor_type()
            .map(|t| format!("{t:?}"))
            .unwrap_or_else(|| format!("{dtype}")),
        shape: dtype
            .tensor_shape()
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default(),
    }
}
