//! Which x86 vector instructions the loops may use: those the CPU has, narrowed by `HOST_SIMD`.
//!
//! Every feature check in this crate goes through `has!`, so one variable moves every loop to
//! a narrower route at once: a machine with AVX-512 (or AMX, which needs AVX-512 here) then
//! measures the AVX2 route, or the portable one, as a CPU without them would run it. Each copy
//! of the crate in the process (the host's and each plugin's) reads the same variable.

use std::sync::OnceLock;

/// The variable that narrows the routes: `auto` (or unset), `avx512`, `avx512-nobf16`, `avx2` or
/// `portable`.
pub const SIMD_ENV: &str = "HOST_SIMD";

/// The widest instructions allowed, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// No vector loops: the portable ones everywhere.
    Portable,
    /// AVX2, FMA and F16C at most.
    Avx2,
    /// AVX-512 without BF16, FP16 or AMX: what Skylake-SP, Cascade Lake and Ice Lake have.
    Avx512NoBf16,
    /// Whatever the CPU has (AVX-512 and AMX included).
    Any,
}

/// What a value of [`SIMD_ENV`] allows.
fn parse(value: Option<&str>) -> Result<Level, String> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") | Some("avx512") => Ok(Level::Any),
        Some("avx512-nobf16") => Ok(Level::Avx512NoBf16),
        Some("avx2") => Ok(Level::Avx2),
        Some("portable") => Ok(Level::Portable),
        Some(other) => {
            Err(format!("{SIMD_ENV}={other:?} is not a route; use auto, avx512, avx512-nobf16, avx2 or portable"))
        }
    }
}

/// The variable that picks how quantized products treat activations on x86 CPUs with AVX2:
/// `float` (the default: float32 sums of dequantized weights, MLX's result up to summation
/// order) or `int8` (rounded to 8-bit integers, as llama.cpp does: faster, less exact;
/// [`crate::quantized_avx2`]). Weights repacked for AMX, and other CPUs, ignore it.
pub const ACTIVATIONS_ENV: &str = "HOST_QUANTIZED_ACTIVATIONS";

/// Whether a value of [`ACTIVATIONS_ENV`] asks for 8-bit activations.
fn parse_activations(value: Option<&str>) -> Result<bool, String> {
    match value.map(str::trim) {
        None | Some("") | Some("float") => Ok(false),
        Some("int8") => Ok(true),
        Some(other) => Err(format!("{ACTIVATIONS_ENV}={other:?} is not a choice; use float or int8")),
    }
}

/// Whether this process asked for 8-bit activations in quantized products (read once).
pub fn int8_activations() -> bool {
    static ASKED: OnceLock<bool> = OnceLock::new();
    *ASKED.get_or_init(|| parse_activations(std::env::var(ACTIVATIONS_ENV).ok().as_deref()).unwrap_or(false))
}

/// Refuses a value of [`SIMD_ENV`] or [`ACTIVATIONS_ENV`] that names no choice (the host
/// checks them at start-up).
pub fn check_env() -> Result<(), String> {
    parse(std::env::var(SIMD_ENV).ok().as_deref())?;
    parse_activations(std::env::var(ACTIVATIONS_ENV).ok().as_deref()).map(|_| ())
}

/// The level this process allows, read once (a value that names none allows everything; the
/// host refuses it at start-up).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| parse(std::env::var(SIMD_ENV).ok().as_deref()).unwrap_or(Level::Any))
}

/// The level a feature belongs to: AVX-512 BF16's, FP16's and AMX's need [`Level::Any`], the
/// rest of AVX-512 [`Level::Avx512NoBf16`], the rest (AVX2, FMA, F16C) [`Level::Avx2`].
pub fn level_of(feature: &str) -> Level {
    if matches!(feature, "avx512bf16" | "avx512fp16") || feature.starts_with("amx") {
        Level::Any
    } else if feature.starts_with("avx512") {
        Level::Avx512NoBf16
    } else {
        Level::Avx2
    }
}

/// Whether `HOST_SIMD` allows `feature`.
pub fn allows(feature: &str) -> bool {
    level() >= level_of(feature)
}

/// Whether the CPU has an x86 feature and [`SIMD_ENV`] allows it: what every loop checks in
/// place of `is_x86_feature_detected!`. (Only x86 code uses it.)
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
macro_rules! has {
    ($feature:tt) => {
        $crate::simd::allows($feature) && std::is_x86_feature_detected!($feature)
    };
}
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
pub(crate) use has;

/// Whether the CPU is Intel's: some loops pick instructions by how its cores issue them.
#[cfg(target_arch = "x86_64")]
pub fn intel() -> bool {
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        let leaf = std::arch::x86_64::__cpuid(0);
        [leaf.ebx, leaf.edx, leaf.ecx].map(u32::to_le_bytes).concat() == *b"GenuineIntel"
    })
}

/// The widest product route this process takes on x86, in words (`amx`, `avx512`,
/// `avx512-nobf16`, `avx2`, `portable`; `+int8` where quantized products round activations to 8
/// bits), for the bench and `host doctor`.
#[cfg(target_arch = "x86_64")]
pub fn product_route() -> &'static str {
    let int8 = crate::quantized_avx2::available();
    if crate::amx_bf16::available() {
        "amx"
    } else if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
        match (int8, has!("avx512bf16")) {
            (true, _) => "avx512+int8",
            (false, true) => "avx512",
            (false, false) => "avx512-nobf16",
        }
    } else if int8 {
        "avx2+int8"
    } else if has!("avx2") && has!("fma") && has!("f16c") {
        "avx2"
    } else {
        "portable"
    }
}

/// The widest product route this process takes: the portable loops off x86.
#[cfg(not(target_arch = "x86_64"))]
pub fn product_route() -> &'static str {
    "portable"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_value_allows_its_level_and_the_narrower_ones() {
        assert_eq!(parse(None), Ok(Level::Any));
        assert_eq!(parse(Some("auto")), Ok(Level::Any));
        assert_eq!(parse(Some(" avx2 ")), Ok(Level::Avx2));
        assert_eq!(parse(Some("avx512-nobf16")), Ok(Level::Avx512NoBf16));
        assert!(Level::Avx512NoBf16 >= level_of("avx512vnni") && Level::Avx512NoBf16 < level_of("avx512bf16"));
        assert!(Level::Avx512NoBf16 < level_of("amx-bf16") && Level::Avx512NoBf16 > level_of("avx2"));
        assert_eq!(parse(Some("portable")), Ok(Level::Portable));
        assert!(Level::Avx2 >= level_of("fma") && Level::Avx2 < level_of("avx512bf16"));
        assert!(Level::Portable < level_of("avx2") && Level::Any >= level_of("amx-tile"));
    }

    #[test]
    fn only_float_and_int8_are_activation_choices() {
        assert_eq!(parse_activations(None), Ok(false));
        assert_eq!(parse_activations(Some("float")), Ok(false));
        assert_eq!(parse_activations(Some(" int8 ")), Ok(true));
        let e = parse_activations(Some("int4")).unwrap_err();
        assert!(e.contains("\"int4\"") && e.contains("float or int8"), "{e}");
    }

    #[test]
    fn an_unknown_value_is_refused_by_name() {
        let e = parse(Some("sse4")).unwrap_err();
        assert!(e.contains("\"sse4\"") && e.contains("auto, avx512, avx512-nobf16, avx2 or portable"), "{e}");
    }
}
