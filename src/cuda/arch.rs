//! A GPU's architecture, `sm_{major}{minor}`: what the probe reads from a device, what
//! NVRTC compiles the kernels for, and what names a kernel cache's files.

/// A real GPU architecture, `sm_{major}{minor}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// The NVRTC option value, e.g. `sm_86`.
    pub fn sm(&self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

/// A word that names no GPU architecture.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a GPU architecture (expected sm_XY, e.g. sm_90)")]
pub struct UnknownArch(pub String);

/// `sm_90`, `sm_120` (or `90`, `120`): the last digit is the minor version. Suffixed
/// targets (`sm_90a`) are refused: the kernels are compiled for the portable feature set.
impl std::str::FromStr for Arch {
    type Err = UnknownArch;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || UnknownArch(s.to_string());
        let digits = s.strip_prefix("sm_").unwrap_or(s);
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(unknown());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        // Only digits are left: a number too large for u32 is the one way to fail.
        let parse = |d: &str| d.parse::<u32>().map_err(|_| unknown());
        Ok(Arch::new(parse(major)?, parse(minor)?))
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

#[cfg(test)]
mod tests {
    use super::Arch;

    #[test]
    fn arch_parses_what_it_prints() {
        for arch in [
            Arch::new(7, 5),
            Arch::new(9, 0),
            Arch::new(10, 0),
            Arch::new(12, 1),
        ] {
            assert_eq!(arch.sm().parse::<Arch>(), Ok(arch));
        }
        assert_eq!("86".parse::<Arch>(), Ok(Arch::new(8, 6)));
        for bad in ["sm_90a", "sm_9", "compute_90", "", "sm_"] {
            assert!(bad.parse::<Arch>().is_err(), "{bad:?} parsed");
        }
    }
}
