//! How many levels an INT8 variant's weights use, set by the CPU that runs it.
//!
//! ONNX Runtime's x86 kernels multiply uint8 activations by int8 weights (u8s8). With VNNI
//! (`vpdpbusd`, AVX-512 VNNI or AVX-VNNI) each product is summed into 32 bits. Without it
//! (AVX2, AVX-512 without VNNI) the kernels use `vpmaddubsw`, which adds two u8 x s8
//! products into a *saturating* int16: 2 x 255 x 127 = 64770 does not fit in 32767, so a
//! bright pixel under a large weight clips silently. On an AVX2 core that moved the
//! fixture's one-convolution mask by 20.5/255 on average (IoU still 1.0); with weights on
//! 7 bits (2 x 255 x 63 = 32130) it is within the gate. ONNX Runtime's own quantizer calls
//! this `reduce_range`. So a variant built on a core without VNNI has 7-bit weights, and
//! one with 8-bit weights is served only where the products cannot saturate.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The weights' width: symmetric levels -127..=127 or -63..=63.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightBits {
    /// Also what manifests written before the field existed hold.
    #[default]
    #[serde(rename = "8")]
    Eight,
    #[serde(rename = "7")]
    Seven,
}

impl WeightBits {
    /// The largest quantized magnitude.
    pub fn levels(self) -> f32 {
        match self {
            WeightBits::Eight => 127.0,
            WeightBits::Seven => 63.0,
        }
    }

    /// What this process's CPU can run without saturating its int16 pair sums.
    pub fn for_this_cpu() -> Self {
        if Int8Products::of_this_cpu().saturate() {
            WeightBits::Seven
        } else {
            WeightBits::Eight
        }
    }

    /// Whether a variant whose weights use `self` computes on `cpu` what its gate measured.
    pub fn runs_exactly_on(self, cpu: Int8Products) -> bool {
        self == WeightBits::Seven || !cpu.saturate()
    }
}

impl fmt::Display for WeightBits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightBits::Eight => "8-bit",
            WeightBits::Seven => "7-bit",
        })
    }
}

/// How a CPU sums ONNX Runtime's u8 x s8 products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Products {
    /// VNNI, or not x86: 32-bit sums.
    Wide,
    /// x86 without VNNI: pairs summed into a saturating int16 first.
    SaturatingPairs,
}

impl Int8Products {
    pub fn of_this_cpu() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512vnni")
                || std::arch::is_x86_feature_detected!("avxvnni")
            {
                Int8Products::Wide
            } else {
                Int8Products::SaturatingPairs
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Int8Products::Wide
        }
    }

    pub fn saturate(self) -> bool {
        self == Int8Products::SaturatingPairs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_widest_pair_sum_of_each_width_against_int16() {
        let pair = |bits: WeightBits| 2.0 * 255.0 * bits.levels();
        assert!(pair(WeightBits::Eight) > f32::from(i16::MAX));
        assert!(pair(WeightBits::Seven) <= f32::from(i16::MAX));
    }

    #[test]
    fn eight_bit_weights_run_exactly_only_where_products_are_wide() {
        assert!(WeightBits::Eight.runs_exactly_on(Int8Products::Wide));
        assert!(!WeightBits::Eight.runs_exactly_on(Int8Products::SaturatingPairs));
        assert!(WeightBits::Seven.runs_exactly_on(Int8Products::Wide));
        assert!(WeightBits::Seven.runs_exactly_on(Int8Products::SaturatingPairs));
    }

    #[test]
    fn the_manifest_spells_the_width_as_a_number_and_defaults_to_eight() {
        assert_eq!(
            serde_json::to_string(&WeightBits::Seven).expect("json"),
            "\"7\""
        );
        assert_eq!(WeightBits::default(), WeightBits::Eight);
    }
}
