//! Paths of the libraries the tests load.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A fixture library built by `make fixtures` into target/fixtures.
pub fn fixture(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../target/fixtures/debug/lib{name}.so"));
    assert!(path.exists(), "{} is missing: build the fixtures first (make fixtures)", path.display());
    path.canonicalize().unwrap()
}

/// A plugin of this workspace, built next to the host binary.
pub fn workspace_plugin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_host")).with_file_name(format!("lib{name}.so"));
    assert!(path.exists(), "{} is missing: build the workspace first (cargo build --workspace)", path.display());
    path
}

/// A fresh plugins directory holding copies of `libraries`.
pub fn plugins_dir_with(libraries: &[&Path]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for lib in libraries {
        std::fs::copy(lib, dir.path().join(lib.file_name().unwrap())).unwrap();
    }
    dir
}
