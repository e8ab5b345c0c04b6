//! `host new-drafter NAME`: a drafter crate of its own, outside any workspace, that builds,
//! passes the conformance kit and drafts on the demo target as written. It depends on this
//! checkout's `plugin-api` by path and takes its MLX link settings (what
//! `scripts/setup.sh --drafter-crate` writes).

use std::path::{Path, PathBuf};

const CARGO_TOML: &str = include_str!("../templates/drafter/Cargo.toml.in");
const LIB_RS: &str = include_str!("../templates/drafter/lib.rs.in");
const DEMO_TOML: &str = include_str!("../templates/drafter/demo.toml.in");
const README: &str = include_str!("../templates/drafter/README.md.in");

#[derive(Debug, thiserror::Error)]
pub enum NewDrafterError {
    #[error(
        "`{0}` is not a drafter name: use a lowercase letter, then lowercase letters, digits or \
         `_` (at most 40), as a crate and a manifest's `kind` both accept"
    )]
    BadName(String),
    #[error("{0} exists and is not empty; name a new directory with --dir")]
    NotEmpty(PathBuf),
    #[error(
        "{0} is missing: this checkout's native MLX is not set up (run `make setup`, or \
         scripts/setup.sh)"
    )]
    NoNativeSetup(PathBuf),
    #[error("cannot write {path}: {error}")]
    Write { path: PathBuf, error: std::io::Error },
}

/// Whether `name` can be both the crate's name and the plugin's kind.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && name.len() <= 40
}

/// Writes the crate `name` into `dir` (which must not exist, or be empty) and returns the
/// files written.
pub fn write(name: &str, dir: &Path, host: &Path) -> Result<Vec<PathBuf>, NewDrafterError> {
    if !valid_name(name) {
        return Err(NewDrafterError::BadName(name.to_owned()));
    }
    if std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(NewDrafterError::NotEmpty(dir.to_owned()));
    }
    let checkout = crate::checkout::root();
    let cargo_config = checkout.join(".native/cargo-config.toml");
    let cargo_config =
        std::fs::read_to_string(&cargo_config).map_err(|_| NewDrafterError::NoNativeSetup(cargo_config))?;
    let library = format!("{}{name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let fill = |template: &str| {
        template
            .replace("@NAME@", name)
            .replace("@PLUGIN_API@", &checkout.join("plugin-api").display().to_string())
            .replace("@MODEL@", &checkout.join("models/kjv-gemma4").display().to_string())
            .replace("@SETUP@", &checkout.join("scripts/setup.sh").display().to_string())
            .replace("@HOST@", &host.display().to_string())
            .replace("@LIBRARY@", &library)
    };
    let files = [
        ("Cargo.toml", fill(CARGO_TOML)),
        ("src/lib.rs", fill(LIB_RS)),
        ("demo.toml", fill(DEMO_TOML)),
        ("README.md", fill(README)),
        (".cargo/config.toml", cargo_config),
        (".gitignore", "/target\n".to_owned()),
    ];
    let mut written = Vec::new();
    for (file, text) in files {
        let path = dir.join(file);
        let write = |path: &Path| {
            std::fs::create_dir_all(path.parent().expect("a file in the crate"))?;
            std::fs::write(path, text)
        };
        write(&path).map_err(|error| NewDrafterError::Write { path: path.clone(), error })?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_what_a_crate_and_a_kind_accept() {
        for good in ["bigram", "my_drafter2", "x"] {
            assert!(valid_name(good), "{good}");
        }
        for bad in ["", "Bigram", "2gram", "my-drafter", "a b", "ü", &"x".repeat(41)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_non_empty_directory_or_a_bad_name_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keep.txt"), "mine").unwrap();
        let host = Path::new("host");
        assert!(matches!(write("bigram", dir.path(), host), Err(NewDrafterError::NotEmpty(_))));
        let fresh = dir.path().join("fresh");
        assert!(matches!(write("Big-ram", &fresh, host), Err(NewDrafterError::BadName(_))));
        assert!(!fresh.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
