//! ONNX Runtime through the `ort` crate, loaded at run time (`load-dynamic`). This module
//! finds the shared library, creates the one process-wide environment, and wraps one
//! session per model per replica. It knows nothing of images: inputs are NCHW f32.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ort::environment::GlobalThreadPoolOptions;
use ort::ep;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use ort::value::TensorRef;

use super::OrtError;
use crate::tensor::Tensor;

/// Where to look for the library when `ORT_DYLIB_PATH` is unset: the project's own
/// virtual environment, which `make python` fills from the pinned onnxruntime wheel.
const VENV_CAPI: &str = "site-packages/onnxruntime/capi";

/// The shared library to load: `ORT_DYLIB_PATH`, else the `.venv` of the checkout that
/// holds the working directory or the executable.
pub fn library_path() -> Result<PathBuf, OrtError> {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(OrtError::LibraryMissing(format!(
                "ORT_DYLIB_PATH={} is not a file; point it at libonnxruntime.so, or unset it and run `make python`",
                path.display()
            )))
        };
    }
    crate::host::wheels::venvs()
        .find_map(|venv| find_in_venv(&venv))
        .ok_or_else(|| {
            OrtError::LibraryMissing(
                "set ORT_DYLIB_PATH to libonnxruntime.so (from the onnxruntime wheel, e.g. \
                 .venv/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime.so.1.31.1), \
                 or run `make python` in the celer checkout to install it"
                    .into(),
            )
        })
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

/// The size of the process's shared intra-op pool, when `share_pool` asked for one before
/// the environment was made.
static SHARED_POOL: OnceLock<usize> = OnceLock::new();

/// Gives the environment a shared intra-op pool of `threads` threads, which sessions
/// loaded with `OpThreads::Shared` run on. Must come before the first session; `celer
/// bench local` uses it to measure that layout against the sessions' own pools.
pub fn share_pool(threads: usize) -> Result<(), OrtError> {
    let threads = threads.max(1);
    if *SHARED_POOL.get_or_init(|| threads) != threads {
        return Err(OrtError::Environment(
            "the shared pool is already sized differently".into(),
        ));
    }
    Ok(())
}

/// The process-wide ONNX Runtime environment. `ort` allows one per process, and loading
/// the library twice is an error, so the first call decides and later calls share it.
pub fn environment() -> Result<&'static ort::environment::Environment, OrtError> {
    static ENV: OnceLock<Result<ort::environment::Environment, OrtError>> = OnceLock::new();
    ENV.get_or_init(|| {
        let path = library_path()?;
        tracing::info!(library = %path.display(), "loading ONNX Runtime");
        let mut builder = ort::init_from(&path)
            .map_err(|e| OrtError::LibraryMissing(format!("cannot load {}: {e}", path.display())))?
            .with_name("celer");
        // Sized now or never: a later `share_pool` finds this value taken.
        let shared = *SHARED_POOL.get_or_init(|| 0);
        if shared > 0 {
            let pool = GlobalThreadPoolOptions::default()
                .with_intra_threads(shared)
                .and_then(|p| p.with_spin_control(false))
                .map_err(|e| OrtError::Environment(format!("cannot size the shared pool: {e}")))?;
            builder = builder.with_global_thread_pool(pool);
        }
        let env = builder
            .build()
            .map_err(|e| OrtError::Environment(format!("cannot create it: {e}")))?;
        // Every session takes its activations from it (`OrtModel::load`).
        super::allocator::register(&env)?;
        Ok(env)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Where a session's operators find their threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpThreads {
    /// Its own pool: `threads` in all (the calling thread is one of them). `alone`: the
    /// session runs only while it has the device to itself (a CPU device's solo set), so
    /// its pool's threads can spin a little before sleeping between operators (about
    /// 10 % of U2NetP's time at 320x320 on 2 cores, measured), which would steal the
    /// cores of sessions that share them.
    Own { threads: usize, alone: bool },
    /// The environment's shared pool (`share_pool`).
    Shared,
}

impl From<usize> for OpThreads {
    /// Its own pool of `threads`, sleeping between operators.
    fn from(threads: usize) -> Self {
        OpThreads::Own {
            threads,
            alone: false,
        }
    }
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
    /// Whether its activations come from the block cache (`load`), not from ONNX
    /// Runtime's own CPU allocator (`load_uncached`).
    cached: bool,
}

impl OrtModel {
    /// Loads `path`, its operators running on `threads`, its activations from the
    /// process's block cache (`block_cache`): a run's freed blocks are kept for the next
    /// run of any session (about 15 % of U2NetP's time at 320x320 on 2 cores, and more
    /// for replicas running side by side, measured), until
    /// `allocator::release_cached` gives them back when the server goes idle.
    pub fn load(path: &Path, threads: impl Into<OpThreads>) -> Result<Self, OrtError> {
        Self::load_with(path, threads.into(), true)
    }

    /// As `load`, its activations from ONNX Runtime's own CPU allocator (malloc, no
    /// arena): the reference the block cache is checked against (tests/block_cache.rs).
    pub fn load_uncached(path: &Path, threads: impl Into<OpThreads>) -> Result<Self, OrtError> {
        Self::load_with(path, threads.into(), false)
    }

    fn load_with(path: &Path, threads: OpThreads, cached: bool) -> Result<Self, OrtError> {
        let label = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let load_err = |reason: String| OrtError::Load {
            model: path.display().to_string(),
            reason,
        };
        let env = environment()?;
        let builder = Session::builder(env)
            .map_err(|e| load_err(e.to_string()))?
            .with_optimization_level(GraphOptimizationLevel::Level3)
            .map_err(|e| load_err(e.to_string()))?
            .with_inter_threads(1)
            .map_err(|e| load_err(e.to_string()))?
            // Denormal activations flushed to zero: about 5 % of U2NetP's time on this
            // CPU, and the same mask on the test photos (values below 1e-38 never reach
            // an 8-bit alpha).
            .with_flush_to_zero()
            .map_err(|e| load_err(e.to_string()))?;
        let builder = match threads {
            OpThreads::Own { threads, alone } => builder
                .with_independent_thread_pool()
                .map_err(|e| load_err(e.to_string()))?
                .with_intra_threads(threads.max(1))
                .map_err(|e| load_err(e.to_string()))?
                .with_intra_op_spinning(alone)
                .map_err(|e| load_err(e.to_string()))?
                // Spinning is for the gaps between a run's operators: once the run
                // returns, the pool's threads sleep at once instead of spinning on
                // cores the request's own stages after the model (and the next request,
                // perhaps another session's) need.
                .with_config_entry("session.force_spinning_stop", if alone { "1" } else { "0" })
                .map_err(|e| load_err(e.to_string()))?,
            OpThreads::Shared if SHARED_POOL.get().is_some_and(|&n| n > 0) => builder,
            OpThreads::Shared => {
                return Err(load_err(
                    "no shared pool: share_pool must come before the first session".into(),
                ))
            }
        };
        let builder = if cached {
            builder
                .with_env_allocators()
                .map_err(|e| load_err(e.to_string()))?
        } else {
            builder
        };
        let session = builder
            // No memory arena: an arena keeps its peak for the session's life (about
            // 475 MB a U2NetP session at 320x320, measured), per session. The block
            // cache keeps what the process's runs need, and gives it back when the
            // server goes idle; an uncached session's activations come from malloc,
            // which `celer serve` tunes and trims when idle (src/main.rs).
            .with_execution_providers([ep::CPU::default().with_arena_allocator(false).build()])
            .map_err(|e| load_err(e.to_string()))?
            .with_memory_pattern(false)
            .map_err(|e| load_err(e.to_string()))?
            .commit_from_file(path)
            .map_err(|e| load_err(e.to_string()))?;
        Ok(Self {
            session,
            label,
            cached,
        })
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
    ) -> Result<Tensor, OrtError> {
        let mut got = self.run_outputs(inputs, &[output])?;
        got.pop().ok_or_else(|| OrtError::Run {
            model: self.label.clone(),
            reason: format!("no output named `{output}`"),
        })
    }

    /// Runs the model on NCHW f32 inputs and returns the float outputs named in
    /// `outputs`, in that order (a replica reads one; calibration many of one run).
    pub fn run_outputs(
        &mut self,
        inputs: &[(&str, [usize; 4], &[f32])],
        outputs: &[&str],
    ) -> Result<Vec<Tensor>, OrtError> {
        let run_err = |reason: String| OrtError::Run {
            model: self.label.clone(),
            reason,
        };
        let _in_flight = self.cached.then(super::allocator::RunInFlight::start);
        let mut values = Vec::with_capacity(inputs.len());
        for (name, shape, data) in inputs {
            let tensor = TensorRef::from_array_view((*shape, *data))
                .map_err(|e| run_err(format!("input `{name}`: {e}")))?;
            values.push((*name, tensor));
        }
        let got = self
            .session
            .run(values)
            .map_err(|e| run_err(e.to_string()))?;
        outputs
            .iter()
            .map(|name| {
                let value = got
                    .get(*name)
                    .ok_or_else(|| run_err(format!("no output named `{name}`")))?;
                let (shape, data) = value
                    .try_extract_tensor::<f32>()
                    .map_err(|e| run_err(format!("output `{name}`: {e}")))?;
                Ok(Tensor {
                    shape: shape.iter().map(|d| (*d).max(0) as usize).collect(),
                    data: data.to_vec(),
                })
            })
            .collect()
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
