//! The source checkout this host was built from: where `new-drafter` points a crate's
//! `plugin-api` and MLX settings, and where the demo target lives.

use std::path::{Path, PathBuf};

/// The checkout's root directory.
pub fn root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    root.canonicalize().unwrap_or(root)
}

/// The demo target, the embedded default manifest's.
pub fn demo_target() -> PathBuf {
    root().join("models/kjv-gemma4")
}
