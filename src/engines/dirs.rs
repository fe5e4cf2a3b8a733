//! Where a server finds engines, and where it writes the ones it builds at start-up. The
//! model folder's `engines/` is what `celer build` wrote and a model archive carries; but
//! SageMaker unpacks the archive as root while celer runs as another user, so that folder
//! may not be writable: engines built at start-up then go to a folder under the temporary
//! directory, which is searched too. `--engines-dir` names one folder for both.

use std::path::{Path, PathBuf};

use super::manifest::ENGINES_DIR;

/// The engine folders of one model directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDirs {
    /// Searched first: `--engines-dir`, else `<model dir>/engines`.
    pub shipped: PathBuf,
    /// Where engines built at start-up are written (and searched after `shipped`): the
    /// same folder when it is writable, else one under the temporary directory.
    pub built: PathBuf,
}

/// Why no folder can take the engines a server would build.
#[derive(Debug, thiserror::Error)]
#[error(
    "no writable folder for the engines built at start-up: {} ({shipped_error}) nor {} \
     ({fallback_error}); name one with --engines-dir",
    shipped.display(),
    fallback.display()
)]
pub struct NoWritableDir {
    pub shipped: PathBuf,
    pub shipped_error: std::io::Error,
    pub fallback: PathBuf,
    pub fallback_error: std::io::Error,
}

impl EngineDirs {
    /// The folders for `model_dir`: `engines_dir` when given (for both); else the model
    /// folder's `engines/`, and, when engines are to be built (`builds`) and that folder
    /// cannot be written, a folder under the temporary directory for them.
    pub fn resolve(
        model_dir: &Path,
        engines_dir: Option<&Path>,
        builds: bool,
    ) -> Result<Self, NoWritableDir> {
        if let Some(dir) = engines_dir {
            return Ok(Self::one(dir.to_path_buf()));
        }
        let shipped = model_dir.join(ENGINES_DIR);
        if !builds {
            return Ok(Self::one(shipped));
        }
        let shipped_error = match writable(&shipped) {
            Ok(()) => return Ok(Self::one(shipped)),
            Err(e) => e,
        };
        let fallback = fallback_dir(model_dir);
        match writable(&fallback) {
            Ok(()) => Ok(Self {
                shipped,
                built: fallback,
            }),
            Err(fallback_error) => Err(NoWritableDir {
                shipped,
                shipped_error,
                fallback,
                fallback_error,
            }),
        }
    }

    fn one(dir: PathBuf) -> Self {
        Self {
            shipped: dir.clone(),
            built: dir,
        }
    }

    /// The folders to search, in order (one when both are the same).
    pub fn search_order(&self) -> Vec<&Path> {
        if self.shipped == self.built {
            vec![&self.shipped]
        } else {
            vec![&self.shipped, &self.built]
        }
    }
}

/// `<temporary dir>/celer-engines/<model folder's name>-<hash of its path>`: one folder
/// per model directory, so that two servers of two models do not share one.
fn fallback_dir(model_dir: &Path) -> PathBuf {
    let absolute = std::path::absolute(model_dir).unwrap_or_else(|_| model_dir.to_path_buf());
    let hash = absolute
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    let name = absolute
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    std::env::temp_dir()
        .join("celer-engines")
        .join(format!("{name}-{hash:016x}"))
}

/// Whether `dir` can be created and written, by trying: permission bits do not say it for
/// a read-only mount, nor for root.
fn writable(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".celer-write-probe-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_folder_serves_when_writable_and_engines_dir_names_one_folder() {
        let model = tempfile::tempdir().unwrap();
        let dirs = EngineDirs::resolve(model.path(), None, true).unwrap();
        assert_eq!(dirs.built, model.path().join("engines"));
        assert_eq!(dirs.search_order(), vec![model.path().join("engines")]);

        let elsewhere = tempfile::tempdir().unwrap();
        let dirs = EngineDirs::resolve(model.path(), Some(elsewhere.path()), true).unwrap();
        assert_eq!(dirs.shipped, elsewhere.path());
        assert_eq!(dirs.built, elsewhere.path());
    }

    #[test]
    fn without_builds_nothing_is_created() {
        let model = tempfile::tempdir().unwrap();
        let dirs = EngineDirs::resolve(model.path(), None, false).unwrap();
        assert_eq!(dirs.built, model.path().join("engines"));
        assert!(!model.path().join("engines").exists());
    }

    #[test]
    fn an_unwritable_model_folder_sends_built_engines_to_the_temporary_directory() {
        // A file where the engines folder would be: it cannot be created, even by root.
        let model = tempfile::tempdir().unwrap();
        std::fs::write(model.path().join("engines"), b"not a folder").unwrap();
        let dirs = EngineDirs::resolve(model.path(), None, true).unwrap();
        assert_eq!(dirs.shipped, model.path().join("engines"));
        assert!(dirs
            .built
            .starts_with(std::env::temp_dir().join("celer-engines")));
        assert!(dirs.built.is_dir());
        assert_eq!(dirs.search_order().len(), 2);
        let again = EngineDirs::resolve(model.path(), None, true).unwrap();
        assert_eq!(again, dirs, "the same model folder gets the same folder");
        let _ = std::fs::remove_dir_all(&dirs.built);
    }
}
