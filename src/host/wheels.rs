//! Where the Python wheels that `make python` installs put the native libraries celer
//! loads at run time (ONNX Runtime, NVRTC): the `.venv` of the checkout that holds the
//! working directory or the executable.

use std::path::{Path, PathBuf};

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
