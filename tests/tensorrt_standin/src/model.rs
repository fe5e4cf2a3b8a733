//! The stand-in's networks run with ONNX Runtime: a model loaded from the plan's bytes, its
//! inputs and outputs described in TensorRT's terms, and a run that reads its inputs from
//! and writes its outputs to raw memory (the stand-in CUDA driver's device memory, which the
//! host can address). Reached from the C++ half through the `#[repr(C)]` interface below
//! (mirrored in cpp/model.cpp).

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

use ort::memory::Allocator;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::{Session, SessionInputValue};
use ort::value::{DynTensor, DynTensorValueType, TensorElementType, ValueType};

const MAX_DIMS: usize = 8;

/// A tensor of the model, as cpp/model.cpp's `RawTensor`.
#[repr(C)]
pub struct RawTensor {
    name: *const c_char,
    is_input: i32,
    data_type: i32,
    nb_dims: i32,
    dims: [i64; MAX_DIMS],
}

/// A tensor's memory for a run, as cpp/model.cpp's `RawBinding`.
#[repr(C)]
pub struct RawBinding {
    name: *const c_char,
    data_type: i32,
    nb_dims: i32,
    dims: [i64; MAX_DIMS],
    data: *mut c_void,
    bytes: usize,
}

struct Tensor {
    name: CString,
    is_input: bool,
    data_type: i32,
    dims: Vec<i64>,
}

/// A loaded model. Runs are serialised (a session runs with `&mut`), as one engine's
/// contexts take turns on the stand-in's single host.
pub struct Model {
    session: Mutex<Session>,
    io: Vec<Tensor>,
}

/// The process's ONNX Runtime environment for the stand-in, from `ORT_DYLIB_PATH` (the
/// library celer itself loads; both share ONNX Runtime's one environment).
fn environment() -> Result<&'static ort::environment::Environment, String> {
    static ENV: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();
    ENV.get_or_init(|| {
        let path = std::env::var_os("ORT_DYLIB_PATH").ok_or(
            "the TensorRT stand-in runs engines with ONNX Runtime: set ORT_DYLIB_PATH to libonnxruntime.so",
        )?;
        ort::init_from(&path)
            .map_err(|e| format!("cannot load ONNX Runtime from {}: {e}", path.to_string_lossy()))?
            .with_name("celer-tensorrt-standin")
            .build()
            .map_err(|e| format!("cannot create the ONNX Runtime environment: {e}"))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// TensorRT's DataType number for an ONNX Runtime element type; None for the ones the
/// stand-in does not run.
fn trt_type(t: TensorElementType) -> Option<i32> {
    Some(match t {
        TensorElementType::Float32 => 0,
        TensorElementType::Float16 => 1,
        TensorElementType::Int8 => 2,
        TensorElementType::Int32 => 3,
        TensorElementType::Bool => 4,
        TensorElementType::Uint8 => 5,
        TensorElementType::Int64 => 8,
        _ => return None,
    })
}

fn ort_type(code: i32) -> Option<(TensorElementType, usize)> {
    Some(match code {
        0 => (TensorElementType::Float32, 4),
        1 => (TensorElementType::Float16, 2),
        2 => (TensorElementType::Int8, 1),
        3 => (TensorElementType::Int32, 4),
        4 => (TensorElementType::Bool, 1),
        5 => (TensorElementType::Uint8, 1),
        8 => (TensorElementType::Int64, 8),
        _ => return None,
    })
}

impl Model {
    fn load(onnx: &[u8]) -> Result<Model, String> {
        let threads = std::env::var("CELER_TRT_STANDIN_THREADS")
            .ok()
            .and_then(|t| t.parse::<usize>().ok())
            .unwrap_or(1)
            .max(1);
        let session = Session::builder(environment()?)
            .map_err(|e| e.to_string())?
            .with_optimization_level(GraphOptimizationLevel::Level3)
            .map_err(|e| e.to_string())?
            .with_independent_thread_pool()
            .map_err(|e| e.to_string())?
            .with_intra_threads(threads)
            .map_err(|e| e.to_string())?
            .with_inter_threads(1)
            .map_err(|e| e.to_string())?
            .commit_from_memory(onnx)
            .map_err(|e| e.to_string())?;
        let mut io = Vec::new();
        let outlets = session
            .inputs()
            .iter()
            .map(|o| (o, true))
            .chain(session.outputs().iter().map(|o| (o, false)));
        for (outlet, is_input) in outlets {
            let what = if is_input { "input" } else { "output" };
            let (element, shape) = match outlet.dtype() {
                ValueType::Tensor { ty, shape, .. } => (*ty, shape.iter().copied().collect()),
                other => {
                    return Err(format!(
                        "{what} `{}` is {other}, not a tensor",
                        outlet.name()
                    ))
                }
            };
            let data_type = trt_type(element).ok_or_else(|| {
                format!(
                    "{what} `{}` has element type {element:?}, which the stand-in does not run",
                    outlet.name()
                )
            })?;
            io.push(Tensor {
                name: CString::new(outlet.name()).map_err(|e| e.to_string())?,
                is_input,
                data_type,
                dims: shape,
            });
        }
        Ok(Model {
            session: Mutex::new(session),
            io,
        })
    }

    /// Runs the model: each input from its memory (zeros where `data` is null); each
    /// output's shape written back to its binding, and its values copied to `data` unless
    /// that is null, where `bytes` must be exactly the output's size.
    fn run(&self, inputs: &[RawBinding], outputs: &mut [RawBinding]) -> Result<(), String> {
        let allocator = Allocator::default();
        let mut values: Vec<(String, SessionInputValue<'_>)> = Vec::with_capacity(inputs.len());
        for binding in inputs {
            // SAFETY: the C++ half passes NUL-terminated names that outlive the call.
            let name = unsafe { CStr::from_ptr(binding.name) }
                .to_string_lossy()
                .into_owned();
            let (element, size) = ort_type(binding.data_type)
                .ok_or_else(|| format!("input `{name}`: element type {}", binding.data_type))?;
            let rank = usize::try_from(binding.nb_dims)
                .ok()
                .filter(|&r| r <= MAX_DIMS)
                .ok_or_else(|| format!("input `{name}`: rank {}", binding.nb_dims))?;
            let shape = binding.dims[..rank].to_vec();
            let count: i64 = shape.iter().product();
            let bytes = usize::try_from(count)
                .map_err(|_| format!("input `{name}`: shape {shape:?}"))?
                * size;
            let mut tensor = DynTensor::new(&allocator, element, shape)
                .map_err(|e| format!("input `{name}`: {e}"))?;
            if !binding.data.is_null() && bytes > 0 {
                // SAFETY: the C++ half checked that `data` lies in a live device allocation
                // of at least the input's bytes (the stand-in driver's checks of the
                // work's ranges); the tensor's buffer holds exactly `bytes`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        binding.data.cast::<u8>(),
                        tensor.data_ptr_mut().cast::<u8>(),
                        bytes,
                    );
                }
            } else if bytes > 0 {
                // SAFETY: the tensor's buffer holds `bytes` (ONNX Runtime does not zero it).
                unsafe { std::ptr::write_bytes(tensor.data_ptr_mut().cast::<u8>(), 0, bytes) };
            }
            values.push((name, tensor.into()));
        }
        let mut session = self.session.lock().unwrap_or_else(|p| p.into_inner());
        let mut results = session.run(values).map_err(|e| e.to_string())?;
        for binding in outputs.iter_mut() {
            // SAFETY: as for the inputs' names.
            let name = unsafe { CStr::from_ptr(binding.name) }
                .to_string_lossy()
                .into_owned();
            let value = results
                .remove(&name)
                .ok_or_else(|| format!("the model has no output `{name}`"))?
                .downcast::<DynTensorValueType>()
                .map_err(|e| format!("output `{name}`: {e}"))?;
            let (element, shape) = match value.dtype() {
                ValueType::Tensor { ty, shape, .. } => {
                    (*ty, shape.iter().copied().collect::<Vec<i64>>())
                }
                other => return Err(format!("output `{name}` is {other}")),
            };
            let (_, size) = trt_type(element)
                .and_then(ort_type)
                .ok_or_else(|| format!("output `{name}`: element type {element:?}"))?;
            if shape.len() > MAX_DIMS {
                return Err(format!("output `{name}` has rank {}", shape.len()));
            }
            binding.nb_dims = shape.len() as i32;
            binding.dims[..shape.len()].copy_from_slice(&shape);
            if binding.data.is_null() {
                continue;
            }
            let count: i64 = shape.iter().product();
            let bytes = usize::try_from(count).unwrap_or(0) * size;
            if bytes != binding.bytes {
                return Err(format!(
                    "output `{name}` came out {shape:?} ({bytes} bytes), its binding holds {} bytes",
                    binding.bytes
                ));
            }
            // SAFETY: `data` holds `binding.bytes` (the C++ half's staging in the context's
            // activation memory); the value's buffer holds `bytes`, which is equal.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    value.data_ptr().cast::<u8>(),
                    binding.data.cast::<u8>(),
                    bytes,
                );
            }
        }
        Ok(())
    }
}

/// Writes `message` into the C buffer `why` (truncated, NUL-terminated).
fn tell(why: *mut c_char, why_len: usize, message: &str) {
    if why.is_null() || why_len == 0 {
        return;
    }
    let n = message.len().min(why_len - 1);
    // SAFETY: the caller's buffer holds `why_len` bytes; `n + 1` of them are written.
    unsafe {
        std::ptr::copy_nonoverlapping(message.as_ptr(), why.cast::<u8>(), n);
        *why.add(n) = 0;
    }
}

/// Loads a model from `len` bytes at `onnx`; null (and the reason in `why`) on failure.
#[no_mangle]
pub extern "C" fn celer_trt_standin_ort_load(
    onnx: *const u8,
    len: usize,
    why: *mut c_char,
    why_len: usize,
) -> *mut c_void {
    let result = std::panic::catch_unwind(|| {
        if onnx.is_null() {
            return Err("no model bytes".to_string());
        }
        // SAFETY: the C++ half passes its vector's data and length.
        let bytes = unsafe { std::slice::from_raw_parts(onnx, len) };
        Model::load(bytes)
    });
    match result {
        Ok(Ok(model)) => Box::into_raw(Box::new(model)).cast::<c_void>(),
        Ok(Err(message)) => {
            tell(why, why_len, &message);
            std::ptr::null_mut()
        }
        Err(_) => {
            tell(why, why_len, "ONNX Runtime panicked loading the model");
            std::ptr::null_mut()
        }
    }
}

/// # Safety (of every function below)
/// `model` is a pointer returned by `celer_trt_standin_ort_load` and not yet freed.
fn model<'a>(model: *const c_void) -> &'a Model {
    // SAFETY: the contract above.
    unsafe { &*model.cast::<Model>() }
}

#[no_mangle]
pub extern "C" fn celer_trt_standin_ort_io_count(handle: *const c_void) -> i32 {
    model(handle).io.len() as i32
}

#[no_mangle]
pub extern "C" fn celer_trt_standin_ort_io(
    handle: *const c_void,
    index: i32,
    out: *mut RawTensor,
) -> i32 {
    let Some(tensor) = usize::try_from(index)
        .ok()
        .and_then(|i| model(handle).io.get(i))
    else {
        return 1;
    };
    let mut dims = [0i64; MAX_DIMS];
    let rank = tensor.dims.len().min(MAX_DIMS);
    dims[..rank].copy_from_slice(&tensor.dims[..rank]);
    // SAFETY: `out` is the C++ half's RawTensor; the name stays owned by the model.
    unsafe {
        *out = RawTensor {
            name: tensor.name.as_ptr(),
            is_input: i32::from(tensor.is_input),
            data_type: tensor.data_type,
            nb_dims: rank as i32,
            dims,
        };
    }
    0
}

#[no_mangle]
pub extern "C" fn celer_trt_standin_ort_run(
    handle: *const c_void,
    inputs: *const RawBinding,
    n_inputs: usize,
    outputs: *mut RawBinding,
    n_outputs: usize,
    why: *mut c_char,
    why_len: usize,
) -> i32 {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the C++ half passes its vectors' data and lengths (possibly empty).
        let (inputs, outputs) = unsafe {
            (
                if n_inputs == 0 {
                    &[][..]
                } else {
                    std::slice::from_raw_parts(inputs, n_inputs)
                },
                if n_outputs == 0 {
                    &mut [][..]
                } else {
                    std::slice::from_raw_parts_mut(outputs, n_outputs)
                },
            )
        };
        model(handle).run(inputs, outputs)
    }));
    let message = match result {
        Ok(Ok(())) => return 0,
        Ok(Err(message)) => message,
        Err(_) => "ONNX Runtime panicked running the model".to_string(),
    };
    tell(why, why_len, &message);
    1
}

#[no_mangle]
pub extern "C" fn celer_trt_standin_ort_free(handle: *mut c_void) {
    if !handle.is_null() {
        // SAFETY: made by Box::into_raw in celer_trt_standin_ort_load, freed once.
        drop(unsafe { Box::from_raw(handle.cast::<Model>()) });
    }
}
