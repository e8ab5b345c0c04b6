//! The plugin API version, checked before anything else when a library is loaded.

/// Raised when a change would break plugins built against an earlier major. **ABI-frozen.**
pub const API_MAJOR: u32 = 1;
/// Raised when a change adds something; plugins of an older minor keep loading.
pub const API_MINOR: u32 = 2;
/// `API_MAJOR.API_MINOR.0`, as abi_stable records it in every plugin's library header.
pub const API_VERSION: &str = "1.2.0";
