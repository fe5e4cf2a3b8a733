//! The user's image folders a build reads: calibration (ranges, the search) and
//! validation (the gate), decoded as requests are.

use std::path::Path;

use image::RgbImage;

use crate::codec::decode::{decode, image_files, DecodeLimits, IMAGE_EXTENSIONS};

use super::QuantizeError;

/// One decoded image and its name (the file's), for tables.
pub struct NamedImage {
    pub name: String,
    pub rgb: RgbImage,
}

/// Every image file directly in `dir`, by name; an empty folder or an undecodable file
/// is an error naming it.
pub fn load_dir(dir: &Path, role: &str) -> Result<Vec<NamedImage>, QuantizeError> {
    let files = image_files(dir).map_err(|e| QuantizeError::Images {
        dir: dir.to_path_buf(),
        reason: format!("the {role} folder cannot be read: {e}"),
    })?;
    if files.is_empty() {
        return Err(QuantizeError::Images {
            dir: dir.to_path_buf(),
            reason: format!(
                "the {role} folder holds no images ({})",
                IMAGE_EXTENSIONS.join(", ")
            ),
        });
    }
    files
        .iter()
        .map(|path| {
            let bytes = std::fs::read(path).map_err(|e| QuantizeError::Images {
                dir: path.clone(),
                reason: e.to_string(),
            })?;
            let rgb =
                decode(&bytes, &DecodeLimits::default()).map_err(|e| QuantizeError::Images {
                    dir: path.clone(),
                    reason: e.to_string(),
                })?;
            Ok(NamedImage {
                name: path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                rgb,
            })
        })
        .collect()
}
