//! Which devices a server runs on (`--devices auto|cpu|0,1,...`) and how many replicas
//! each gets. `auto` is every GPU the CUDA probe finds, else the CPU. Simulated devices
//! are not devices here: see `sim`.

use std::fmt;
use std::str::FromStr;

/// One place a pipeline can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU through ONNX Runtime: replicas split the cores.
    Cpu,
    /// A GPU by CUDA ordinal.
    Gpu(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Gpu(n) => write!(f, "gpu{n}"),
        }
    }
}

/// What `--devices` asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelection {
    /// Every GPU the probe finds, else the CPU.
    Auto,
    Cpu,
    /// These CUDA ordinals, in this order, without repeats.
    Gpus(Vec<u32>),
}

/// A `--devices` value that names no devices, or GPUs the probe did not find.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "simulated devices are for `celer sim` (capacity planning) only; serve takes auto, cpu or GPU ordinals"
    )]
    Simulated,
    #[error("`{0}`: expected auto, cpu, or GPU ordinals like 0,1,2")]
    NotOrdinals(String),
    #[error("`{text}`: GPU {ordinal} is named twice")]
    Repeated { text: String, ordinal: u32 },
    #[error(
        "GPU {} not found (the probe found {}); use --devices cpu or auto",
        list(.missing),
        if .found.is_empty() { "none".to_string() } else { format!("{:?}", .found) }
    )]
    NotFound { missing: Vec<u32>, found: Vec<u32> },
}

/// `1, 3`.
fn list(ordinals: &[u32]) -> String {
    ordinals
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for DeviceSelection {
    type Err = DeviceError;

    fn from_str(text: &str) -> Result<Self, DeviceError> {
        match text.trim() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            t if t.starts_with("sim:") => Err(DeviceError::Simulated),
            t => {
                let mut ordinals = Vec::new();
                for part in t.split(',') {
                    let n: u32 = part
                        .trim()
                        .parse()
                        .map_err(|_| DeviceError::NotOrdinals(text.to_string()))?;
                    if ordinals.contains(&n) {
                        return Err(DeviceError::Repeated {
                            text: text.to_string(),
                            ordinal: n,
                        });
                    }
                    ordinals.push(n);
                }
                Ok(Self::Gpus(ordinals))
            }
        }
    }
}

impl DeviceSelection {
    /// The devices to run on, given the GPU ordinals a probe found.
    pub fn resolve(&self, gpus_found: &[u32]) -> Result<Vec<Device>, DeviceError> {
        match self {
            Self::Auto if gpus_found.is_empty() => Ok(vec![Device::Cpu]),
            Self::Auto => Ok(gpus_found.iter().map(|&n| Device::Gpu(n)).collect()),
            Self::Cpu => Ok(vec![Device::Cpu]),
            Self::Gpus(asked) => {
                let missing: Vec<u32> = asked
                    .iter()
                    .copied()
                    .filter(|n| !gpus_found.contains(n))
                    .collect();
                if missing.is_empty() {
                    Ok(asked.iter().map(|&n| Device::Gpu(n)).collect())
                } else {
                    Err(DeviceError::NotFound {
                        missing,
                        found: gpus_found.to_vec(),
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_parses_the_three_forms() {
        assert_eq!("auto".parse(), Ok(DeviceSelection::Auto));
        assert_eq!("cpu".parse(), Ok(DeviceSelection::Cpu));
        assert_eq!("0, 2".parse(), Ok(DeviceSelection::Gpus(vec![0, 2])));
        assert!("0,0"
            .parse::<DeviceSelection>()
            .unwrap_err()
            .to_string()
            .contains("twice"));
        assert!("gpu".parse::<DeviceSelection>().is_err());
        let sim = "sim:1,1"
            .parse::<DeviceSelection>()
            .unwrap_err()
            .to_string();
        assert!(sim.contains("celer sim"), "{sim}");
    }

    #[test]
    fn auto_is_every_gpu_found_else_the_cpu() {
        assert_eq!(DeviceSelection::Auto.resolve(&[]), Ok(vec![Device::Cpu]));
        assert_eq!(
            DeviceSelection::Auto.resolve(&[0, 1]),
            Ok(vec![Device::Gpu(0), Device::Gpu(1)])
        );
        let err = DeviceSelection::Gpus(vec![1])
            .resolve(&[0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("GPU 1 not found"), "{err}");
        assert_eq!(Device::Gpu(3).to_string(), "gpu3");
    }
}
