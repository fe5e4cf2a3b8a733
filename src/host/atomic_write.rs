//! Writing a file so that no reader, and no crash, ever sees half of it: engine plans and
//! their manifests, and the kernel cache.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes through a temporary file in the same folder and renames it into place, so a
/// reader (or a crash) never sees half a plan or manifest.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Unique per call, not only per process: `serve` may store engines from several
    // threads, and two writers of one temporary file would rename each other's half.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{name}.tmp{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
