//! The stand-in for builds without the `tensorrt` feature: the same names and signatures
//! as `runtime` and `builder`, so that callers compile unchanged, where loading returns
//! `TrtError::NotBuilt`. No value of these types can exist, so their methods are
//! unreachable by construction (`match self.never {}`), not by a panic.

use std::path::Path;
use std::sync::Arc;

use super::types::{
    BuildProgress, BuildSettings, BuiltEngine, CudaContextScope, CudaStream, DevicePtr,
    InputProfile, LibraryPaths, TensorDesc, TrtError, TrtVersion,
};

#[derive(Debug, Clone, Copy)]
enum Never {}

#[derive(Debug, Clone)]
pub struct TensorRt {
    never: Never,
}

impl TensorRt {
    /// `None`: no TensorRT headers were compiled in.
    pub fn compiled_version() -> Option<TrtVersion> {
        None
    }

    pub fn compiled_parser_version() -> Option<TrtVersion> {
        None
    }

    pub fn load_runtime() -> Result<Self, TrtError> {
        Err(TrtError::NotBuilt)
    }

    pub fn load_builder() -> Result<Self, TrtError> {
        Err(TrtError::NotBuilt)
    }

    pub fn load(_paths: &LibraryPaths, _with_parser: bool) -> Result<Self, TrtError> {
        Err(TrtError::NotBuilt)
    }

    pub fn version(&self) -> TrtVersion {
        match self.never {}
    }

    pub fn library_file(&self) -> &Path {
        match self.never {}
    }

    pub fn runtime(&self, _context: Arc<dyn CudaContextScope>) -> Result<Runtime, TrtError> {
        match self.never {}
    }

    pub fn parse_onnx(&self, _onnx: &Path) -> Result<Network, TrtError> {
        match self.never {}
    }
}

#[derive(Debug, Clone)]
pub struct Runtime {
    never: Never,
}

impl Runtime {
    pub fn deserialize(&self, _plan: &[u8]) -> Result<Arc<Engine>, TrtError> {
        match self.never {}
    }
}

#[derive(Debug)]
pub struct Engine {
    never: Never,
}

impl Engine {
    pub fn io_tensors(&self) -> &[TensorDesc] {
        match self.never {}
    }

    #[allow(unreachable_code)]
    pub fn inputs(&self) -> impl Iterator<Item = &TensorDesc> {
        match self.never {}
        std::iter::empty()
    }

    #[allow(unreachable_code)]
    pub fn outputs(&self) -> impl Iterator<Item = &TensorDesc> {
        match self.never {}
        std::iter::empty()
    }

    pub fn profile_count(&self) -> Result<usize, TrtError> {
        match self.never {}
    }

    pub fn profile(&self, _name: &str, _index: usize) -> Result<InputProfile, TrtError> {
        match self.never {}
    }

    pub fn device_memory_bytes(&self) -> Result<u64, TrtError> {
        match self.never {}
    }

    pub fn create_context(self: &Arc<Self>) -> Result<ExecutionContext, TrtError> {
        match self.never {}
    }

    /// # Safety
    /// As with the `tensorrt` feature; unreachable here.
    pub unsafe fn create_context_with_memory(
        self: &Arc<Self>,
        _memory: DevicePtr,
        _bytes: u64,
    ) -> Result<ExecutionContext, TrtError> {
        match self.never {}
    }
}

#[derive(Debug)]
pub struct ExecutionContext {
    never: Never,
}

impl ExecutionContext {
    pub fn engine(&self) -> &Arc<Engine> {
        match self.never {}
    }

    pub fn set_optimization_profile(
        &mut self,
        _index: usize,
        _stream: CudaStream,
    ) -> Result<(), TrtError> {
        match self.never {}
    }

    pub fn set_input_shape(&mut self, _name: &str, _shape: &[i64]) -> Result<(), TrtError> {
        match self.never {}
    }

    pub fn tensor_shape(&self, _name: &str) -> Result<Vec<i64>, TrtError> {
        match self.never {}
    }

    /// # Safety
    /// As with the `tensorrt` feature; unreachable here.
    pub unsafe fn set_tensor_address(
        &mut self,
        _name: &str,
        _address: DevicePtr,
    ) -> Result<(), TrtError> {
        match self.never {}
    }

    /// # Safety
    /// As with the `tensorrt` feature; unreachable here.
    pub unsafe fn enqueue(&mut self, _stream: CudaStream) -> Result<(), TrtError> {
        match self.never {}
    }
}

/// Neither Send nor Sync, as with the feature.
#[derive(Debug)]
pub struct Network {
    never: Never,
    _one_thread: std::marker::PhantomData<*const ()>,
}

impl Network {
    pub fn source(&self) -> &Path {
        match self.never {}
    }

    pub fn inputs(&self) -> Result<Vec<TensorDesc>, TrtError> {
        match self.never {}
    }

    pub fn outputs(&self) -> Result<Vec<TensorDesc>, TrtError> {
        match self.never {}
    }

    pub fn build(
        &mut self,
        _settings: &BuildSettings,
        _progress: &(dyn Fn(BuildProgress<'_>) + Sync),
    ) -> Result<BuiltEngine, TrtError> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loading_says_how_to_get_tensorrt() {
        let err = TensorRt::load_builder().unwrap_err();
        assert_eq!(err, TrtError::NotBuilt);
        let msg = err.to_string();
        assert!(msg.contains("built without TensorRT"), "{msg}");
        assert!(msg.contains("--features tensorrt"), "{msg}");
        assert!(TensorRt::compiled_version().is_none());
    }
}
