//! Optimisation-profile shapes for `celer build`: from each input's declared shape (-1
//! where dynamic), the image sizes the pipeline description feeds it, and the user's
//! `--batch` / `--min` / `--opt` / `--max`. Pure functions, so the same answer is
//! printed on a CPU-only machine (from ONNX Runtime's view of the model) as is built on a
//! GPU (from TensorRT's).

use std::path::Path;
use std::str::FromStr;

use crate::spec::{MattingSpec, PipelineSpec};

use crate::tensorrt::InputProfile;

/// A profile that cannot be built from what was asked: a `--batch`, `--min`, `--opt` or
/// `--max` that does not parse, or shapes that do not fit the model's inputs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ProfileError(pub String);

/// A batch range: `N`, `MIN:MAX` (optimised for MAX) or `MIN:OPT:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchRange {
    pub min: i64,
    pub opt: i64,
    pub max: i64,
}

impl FromStr for BatchRange {
    type Err = ProfileError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ProfileError(format!("`{s}` is not N, MIN:MAX or MIN:OPT:MAX"));
        let numbers = s
            .split(':')
            .map(|p| p.trim().parse::<i64>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| bad())?;
        let (min, opt, max) = match numbers[..] {
            [n] => (n, n, n),
            [min, max] => (min, max, max),
            [min, opt, max] => (min, opt, max),
            _ => return Err(bad()),
        };
        if !(1 <= min && min <= opt && opt <= max) {
            return Err(ProfileError(format!(
                "batch range `{s}` needs 1 <= MIN <= OPT <= MAX"
            )));
        }
        Ok(Self { min, opt, max })
    }
}

/// A shape for one named input: `NAME:1x3x320x320`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedShape {
    pub name: String,
    pub dims: Vec<i64>,
}

impl FromStr for NamedShape {
    type Err = ProfileError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            ProfileError(format!(
                "`{s}` is not NAME:DxDx... (e.g. input.1:1x3x320x320)"
            ))
        };
        // Tensor names may contain ':' (e.g. TensorFlow exports), the shape cannot.
        let (name, shape) = s.rsplit_once(':').ok_or_else(bad)?;
        let dims = shape
            .split(['x', 'X', ','])
            .map(|d| d.trim().parse::<i64>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| bad())?;
        if name.is_empty() || dims.is_empty() || dims.iter().any(|d| *d < 1) {
            return Err(bad());
        }
        Ok(Self {
            name: name.to_string(),
            dims,
        })
    }
}

/// What the user asked for on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShapeRequest {
    pub batch: Option<BatchRange>,
    pub min: Vec<NamedShape>,
    pub opt: Vec<NamedShape>,
    pub max: Vec<NamedShape>,
}

/// The NCHW shape (batch 1) that the pipeline feeds an input of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeHint {
    pub name: String,
    pub nchw: [i64; 4],
}

/// The shapes `spec` feeds to the inputs of the model file `model`.
pub fn shape_hints(spec: &PipelineSpec, model: &Path) -> Vec<ShapeHint> {
    let mut hints = Vec::new();
    let image = &spec.segmentation.image;
    if image.model == model {
        hints.push(ShapeHint {
            name: image.input.clone(),
            nchw: [1, 3, i64::from(image.height), i64::from(image.width)],
        });
    }
    if let MattingSpec::Model {
        image,
        trimap_input,
        ..
    } = &spec.matting
    {
        if image.model == model {
            let (h, w) = (i64::from(image.height), i64::from(image.width));
            hints.push(ShapeHint {
                name: image.input.clone(),
                nchw: [1, 3, h, w],
            });
            hints.push(ShapeHint {
                name: trimap_input.clone(),
                nchw: [1, 1, h, w],
            });
        }
    }
    hints
}

/// The optimisation profile for a model with `inputs` (name, declared shape with -1
/// for dynamic dimensions). Empty when every input is static and nothing was asked.
pub fn resolve_profile(
    inputs: &[(&str, &[i64])],
    hints: &[ShapeHint],
    request: &ShapeRequest,
) -> Result<Vec<InputProfile>, ProfileError> {
    let err = |m: String| ProfileError(m);
    let known: Vec<&str> = inputs.iter().map(|(n, _)| *n).collect();
    for named in request.min.iter().chain(&request.opt).chain(&request.max) {
        if !known.contains(&named.name.as_str()) {
            return Err(err(format!(
                "no input named `{}`; the model's inputs are {}",
                named.name,
                known
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    let mut profile = Vec::new();
    for (name, declared) in inputs {
        let find = |list: &[NamedShape]| {
            list.iter()
                .find(|s| s.name == *name)
                .map(|s| s.dims.clone())
        };
        let explicit = (find(&request.min), find(&request.opt), find(&request.max));
        let entry = match explicit {
            (None, None, None) => derived(name, declared, hints, request.batch)?,
            (Some(min), Some(opt), Some(max)) => Some(InputProfile {
                name: name.to_string(),
                min,
                opt,
                max,
            }),
            _ => {
                return Err(err(format!(
                    "input `{name}`: give all three of --min, --opt and --max, or none"
                )))
            }
        };
        if let Some(entry) = entry {
            check_entry(&entry, declared)?;
            profile.push(entry);
        }
    }
    Ok(profile)
}

/// The range of an input not named on the command line: batch from `--batch` (1 by
/// default: celer runs one image per request), other dynamic dimensions from the
/// pipeline description. `None` for a static input that `--batch` does not change.
fn derived(
    name: &str,
    declared: &[i64],
    hints: &[ShapeHint],
    batch: Option<BatchRange>,
) -> Result<Option<InputProfile>, ProfileError> {
    let dynamic = declared.iter().any(|d| *d < 0);
    if let (Some(b), Some(&fixed)) = (batch, declared.first()) {
        if fixed >= 0 && (b.min, b.opt, b.max) != (fixed, fixed, fixed) {
            return Err(ProfileError(format!(
                "input `{name}` has a fixed batch of {fixed} in the ONNX model; export it with a \
                 dynamic batch dimension to build for batches {}:{}:{}",
                b.min, b.opt, b.max
            )));
        }
    }
    if !dynamic {
        return Ok(None);
    }
    let hint = hints.iter().find(|h| h.name == name);
    let (mut min, mut opt, mut max) = (declared.to_vec(), declared.to_vec(), declared.to_vec());
    for (i, d) in declared.iter().enumerate() {
        if *d >= 0 {
            continue;
        }
        let (lo, mid, hi) = if i == 0 {
            batch.map_or((1, 1, 1), |b| (b.min, b.opt, b.max))
        } else if let Some(size) = hint.filter(|_| declared.len() == 4).map(|h| h.nchw[i]) {
            (size, size, size)
        } else {
            let example: Vec<String> = declared
                .iter()
                .map(|d| if *d < 0 { "N".into() } else { d.to_string() })
                .collect();
            return Err(ProfileError(format!(
                "input `{name}` has a dynamic dimension {i} that celer.toml does not size; give \
                 --min/--opt/--max {name}:{}",
                example.join("x")
            )));
        };
        min[i] = lo;
        opt[i] = mid;
        max[i] = hi;
    }
    Ok(Some(InputProfile {
        name: name.to_string(),
        min,
        opt,
        max,
    }))
}

fn check_entry(entry: &InputProfile, declared: &[i64]) -> Result<(), ProfileError> {
    let name = &entry.name;
    for (label, dims) in [
        ("min", &entry.min),
        ("opt", &entry.opt),
        ("max", &entry.max),
    ] {
        if dims.len() != declared.len() {
            return Err(ProfileError(format!(
                "input `{name}`: --{label} has {} dimensions, the model's input has {} ({declared:?})",
                dims.len(),
                declared.len()
            )));
        }
        for (i, (d, want)) in dims.iter().zip(declared).enumerate() {
            if *want >= 0 && d != want {
                return Err(ProfileError(format!(
                    "input `{name}`: --{label} gives {d} for dimension {i}, which the model fixes at {want}"
                )));
            }
        }
    }
    let ordered =
        (0..declared.len()).all(|i| entry.min[i] <= entry.opt[i] && entry.opt[i] <= entry.max[i]);
    if !ordered {
        return Err(ProfileError(format!(
            "input `{name}`: needs min <= opt <= max in every dimension, got {:?} / {:?} / {:?}",
            entry.min, entry.opt, entry.max
        )));
    }
    Ok(())
}

/// `1x3x320x320`.
pub fn shape_string(dims: &[i64]) -> String {
    dims.iter()
        .map(|d| {
            if *d < 0 {
                "?".to_string()
            } else {
                d.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("x")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(name: &str, h: i64, w: i64) -> ShapeHint {
        ShapeHint {
            name: name.into(),
            nchw: [1, 3, h, w],
        }
    }

    #[test]
    fn static_model_needs_no_profile() {
        let shape = [1, 3, 320, 320];
        let p = resolve_profile(&[("input.1", &shape)], &[], &ShapeRequest::default()).unwrap();
        assert!(p.is_empty());
    }

    #[test]
    fn dynamic_spatial_dims_come_from_the_pipeline() {
        let shape = [-1, 3, -1, -1];
        let p = resolve_profile(
            &[("img", &shape)],
            &[hint("img", 1024, 768)],
            &ShapeRequest::default(),
        )
        .unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].min, vec![1, 3, 1024, 768]);
        assert_eq!(p[0].opt, p[0].min);
        assert_eq!(p[0].max, p[0].min);
    }

    #[test]
    fn batch_range_applies_to_dynamic_batch() {
        let shape = [-1, 3, 320, 320];
        let request = ShapeRequest {
            batch: Some("1:4:8".parse().unwrap()),
            ..ShapeRequest::default()
        };
        let p = resolve_profile(&[("x", &shape)], &[], &request).unwrap();
        assert_eq!(p[0].min[0], 1);
        assert_eq!(p[0].opt[0], 4);
        assert_eq!(p[0].max, vec![8, 3, 320, 320]);
    }

    #[test]
    fn batch_range_on_a_fixed_batch_is_refused() {
        let shape = [1, 3, 320, 320];
        let request = ShapeRequest {
            batch: Some("1:8".parse().unwrap()),
            ..ShapeRequest::default()
        };
        let msg = resolve_profile(&[("x", &shape)], &[], &request)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("fixed batch of 1"), "{msg}");
        // Batch 1 on a batch-1 model is fine and needs no profile.
        let one = ShapeRequest {
            batch: Some("1".parse().unwrap()),
            ..ShapeRequest::default()
        };
        assert!(resolve_profile(&[("x", &shape)], &[], &one)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn unsized_dynamic_dimension_asks_for_explicit_shapes() {
        let shape = [1, -1];
        let msg = resolve_profile(&[("tokens", &shape)], &[], &ShapeRequest::default())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("--min/--opt/--max tokens:1xN"), "{msg}");
    }

    #[test]
    fn explicit_shapes_are_checked_against_the_model() {
        let shape = [-1, 3, -1, -1];
        let request = |min: &str, opt: &str, max: &str| ShapeRequest {
            batch: None,
            min: vec![min.parse().unwrap()],
            opt: vec![opt.parse().unwrap()],
            max: vec![max.parse().unwrap()],
        };
        let ok = request("x:1x3x256x256", "x:1x3x512x512", "x:2x3x1024x1024");
        let p = resolve_profile(&[("x", &shape)], &[], &ok).unwrap();
        assert_eq!(p[0].max, vec![2, 3, 1024, 1024]);

        let wrong_channels = request("x:1x4x256x256", "x:1x3x512x512", "x:1x3x512x512");
        let msg = resolve_profile(&[("x", &shape)], &[], &wrong_channels)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("fixes at 3"), "{msg}");

        let unordered = request("x:1x3x512x512", "x:1x3x256x256", "x:1x3x1024x1024");
        let msg = resolve_profile(&[("x", &shape)], &[], &unordered)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("min <= opt <= max"), "{msg}");

        let mut partial = ok.clone();
        partial.opt.clear();
        let msg = resolve_profile(&[("x", &shape)], &[], &partial)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("all three"), "{msg}");

        let unknown = request("y:1x3x1x1", "y:1x3x1x1", "y:1x3x1x1");
        let msg = resolve_profile(&[("x", &shape)], &[], &unknown)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("no input named `y`"), "{msg}");
    }

    #[test]
    fn command_line_words_parse() {
        assert_eq!(
            "2:8".parse::<BatchRange>().unwrap(),
            BatchRange {
                min: 2,
                opt: 8,
                max: 8
            }
        );
        assert!("8:1".parse::<BatchRange>().is_err());
        assert!("0".parse::<BatchRange>().is_err());
        let s: NamedShape = "scope:input:0:1x3x224x224".parse().unwrap();
        assert_eq!(s.name, "scope:input:0");
        assert_eq!(s.dims, vec![1, 3, 224, 224]);
        assert!("input.1".parse::<NamedShape>().is_err());
        assert!("x:1x0".parse::<NamedShape>().is_err());
        assert_eq!(shape_string(&[-1, 3, 320, 320]), "?x3x320x320");
    }

    #[test]
    fn hints_follow_the_pipeline_description() {
        let text = include_str!("../../onnx/u2netp/celer.toml");
        let spec = PipelineSpec::parse(text, Path::new("/m/celer.toml")).unwrap();
        let hints = shape_hints(&spec, Path::new("/m/u2netp.onnx"));
        assert_eq!(hints, vec![hint("input.1", 320, 320)]);
        assert!(shape_hints(&spec, Path::new("/m/other.onnx")).is_empty());
    }
}
