//! Where drafter plugins are looked for.

use std::path::PathBuf;

/// The environment variable that names the plugins directory when no flag does.
pub const PLUGINS_DIR_ENV: &str = "HOST_PLUGINS_DIR";

/// The plugins directory: the `--plugins-dir` flag, else `$HOST_PLUGINS_DIR`, else the
/// directory of the host executable (where cargo puts the workspace's plugin libraries).
pub fn resolve(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| std::env::var_os(PLUGINS_DIR_ENV).filter(|v| !v.is_empty()).map(PathBuf::from))
        .or_else(|| std::env::current_exe().ok()?.parent().map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("."))
}
