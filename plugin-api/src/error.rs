//! The one error type that crosses the boundary.

use std::fmt;

use abi_stable::std_types::RString;
use abi_stable::StableAbi;

/// What class of failure a [`PluginError`] is. An open set: new kinds may be added, so match
/// with a fallback. **ABI-frozen** (a `u8`).
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorKind(pub u8);

impl ErrorKind {
    /// The artifact (checkpoint directory) is missing, malformed or of an unsupported variant.
    pub const INVALID_ARTIFACT: Self = Self(1);
    /// A manifest option for the drafter is unknown or has a wrong value.
    pub const INVALID_OPTIONS: Self = Self(2);
    /// The target cannot serve this drafter (a missing port, mismatched sizes).
    pub const INCOMPATIBLE_TARGET: Self = Self(3);
    /// The host called with arguments that break the contract.
    pub const INVALID_ARGUMENT: Self = Self(4);
    /// The requested feature is not implemented by this plugin or this host.
    pub const UNSUPPORTED: Self = Self(5);
    /// An MLX operation failed; the message is MLX's.
    pub const MLX: Self = Self(6);
    /// The plugin panicked; the SDK caught it at the boundary.
    pub const PANICKED: Self = Self(7);
    /// Anything else.
    pub const OTHER: Self = Self(255);

    pub fn name(self) -> &'static str {
        match self {
            Self::INVALID_ARTIFACT => "invalid artifact",
            Self::INVALID_OPTIONS => "invalid options",
            Self::INCOMPATIBLE_TARGET => "incompatible target",
            Self::INVALID_ARGUMENT => "invalid argument",
            Self::UNSUPPORTED => "unsupported",
            Self::MLX => "MLX error",
            Self::PANICKED => "panicked",
            _ => "error",
        }
    }
}

impl fmt::Debug for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// An error returned by a plugin entry point or a host callback. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct PluginError {
    pub kind: ErrorKind,
    /// One line a user can act on: what was wrong and where (file, key, tensor).
    pub message: RString,
}

impl PluginError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        PluginError { kind, message: message.into().into() }
    }
    pub fn invalid_artifact(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::INVALID_ARTIFACT, message)
    }
    pub fn invalid_options(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::INVALID_OPTIONS, message)
    }
    pub fn incompatible_target(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::INCOMPATIBLE_TARGET, message)
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::INVALID_ARGUMENT, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::UNSUPPORTED, message)
    }
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

impl std::error::Error for PluginError {}

impl From<mlx_rs::error::Exception> for PluginError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        PluginError::new(ErrorKind::MLX, e.to_string())
    }
}

/// A checkpoint's tensors that cannot be read or have the wrong shape make a bad artifact.
impl From<crate::nn::WeightsError> for PluginError {
    fn from(e: crate::nn::WeightsError) -> Self {
        PluginError::invalid_artifact(e.to_string())
    }
}
