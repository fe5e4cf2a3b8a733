//! The user's image folders a build reads: calibration (ranges, the search) and
//! validation (the gate), decoded as requests are, and the segmentation model's input
//! prepared from each as the CPU replica prepares it.

use std::path::{Path, PathBuf};

use image::RgbImage;

use crate::codec::decode::{decode, DecodeLimits};
use crate::spec::ImageInputSpec;
use crate::stages::preprocess;

use super::QuantizeError;

/// One decoded image and its name (the file's), for tables.
pub struct NamedImage {
    pub name: String,
    pub rgb: RgbImage,
}

const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff"];

/// Every image file directly in `dir`, by name; an empty folder or an undecodable file
/// is an error naming it.
pub fn load_dir(dir: &Path, role: &str) -> Result<Vec<NamedImage>, QuantizeError> {
    let read = std::fs::read_dir(dir).map_err(|e| QuantizeError::Images {
        dir: dir.to_path_buf(),
        reason: format!("the {role} folder cannot be read: {e}"),
    })?;
    let mut files: Vec<PathBuf> = read
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        })
        .collect();
    files.sort();
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

/// The `[1, 3, h, w]` values the segmentation model reads for `image`.
pub fn model_input(image: &RgbImage, spec: &ImageInputSpec) -> Vec<f32> {
    let mut resized = Vec::new();
    preprocess::resize_rgb(image, spec.width, spec.height, &mut resized);
    let mut out = vec![0f32; resized.len()];
    preprocess::normalize_into(&resized, &spec.normalize, &mut out);
    out
}
