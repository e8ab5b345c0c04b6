//! `host new-drafter NAME`: a drafter crate of its own, outside any workspace, that builds,
//! passes the conformance kit and drafts on the demo target as written. It depends on this
//! checkout's `plugin-api` by path and takes its MLX link settings (what
//! `scripts/setup.sh --drafter-crate` writes).

use std::path::{Path, PathBuf};

const CARGO_TOML: &str = include_str!("../templates/drafter/Cargo.toml.in");
const LIB_RS: &str = include_str!("../templates/drafter/lib.rs.in");
const DEMO_TOML: &str = include_str!("../templates/drafter/demo.toml.in");
const README: &str = include_str!("../templates/drafter/README.md.in");
const TRAIN_PY: &str = include_str!("../templates/drafter/train.py.in");
const README_TRAINABLE: &str = include_str!("../templates/drafter/README-trainable.md.in");

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
/// files written. A `trainable` drafter needs an artifact, which its `train.py` fits to a target
/// in the checkout's training environment; its manifest and README name it.
pub fn write(name: &str, dir: &Path, host: &Path, trainable: bool) -> Result<Vec<PathBuf>, NewDrafterError> {
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
    let shown = |path: PathBuf| path.display().to_string();
    let model = shown(checkout.join("models/kjv-gemma4"));
    // What only a trainable crate says; empty in the others.
    let trained = |text: String| if trainable { text } else { String::new() };
    let train = format!(
        "# trained/: the table train.py fits to the demo target (see Training below)\n{} train.py --target {model} --out trained\n",
        checkout.join("training/.venv/bin/python").display()
    );
    let placeholders = [
        ("@TRAIN@", trained(train)),
        ("@ARTIFACT_FLAG@", trained(" --artifact trained".into())),
        ("@ARTIFACT_LINE@", trained("# What train.py wrote.\nartifact = \"trained\"\n".into())),
        ("@SHIP_ARTIFACT@", trained(", with `artifact` naming a copy of `trained/`".into())),
        ("@NEEDS_ARTIFACT@", trained("            .needs_artifact()\n".into())),
        ("@NAME@", name.to_owned()),
        ("@PLUGIN_API@", shown(checkout.join("plugin-api"))),
        ("@MODEL@", model),
        ("@SETUP@", shown(checkout.join("scripts/setup.sh"))),
        ("@TRAINING@", shown(checkout.join("training"))),
        ("@HOST@", host.display().to_string()),
        ("@LIBRARY@", library),
    ];
    let fill =
        |template: &str| placeholders.iter().fold(template.to_owned(), |text, (key, value)| text.replace(key, value));
    let mut readme = fill(README);
    let mut files = vec![
        ("Cargo.toml", fill(CARGO_TOML)),
        ("src/lib.rs", fill(LIB_RS)),
        ("demo.toml", fill(DEMO_TOML)),
        (".cargo/config.toml", cargo_config),
        (".gitignore", "/target\n/trained\n".to_owned()),
    ];
    if trainable {
        readme.push_str(&fill(README_TRAINABLE));
        files.push(("train.py", fill(TRAIN_PY)));
    }
    files.push(("README.md", readme));
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
        assert!(matches!(write("bigram", dir.path(), host, false), Err(NewDrafterError::NotEmpty(_))));
        let fresh = dir.path().join("fresh");
        assert!(matches!(write("Big-ram", &fresh, host, true), Err(NewDrafterError::BadName(_))));
        assert!(!fresh.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// Whether `text` holds a template placeholder, `@` then capitals or `_` then `@`.
    fn has_placeholder(text: &str) -> bool {
        text.match_indices('@').any(|(at, _)| {
            let rest = &text[at + 1..];
            let name = rest.find(|c: char| !(c.is_ascii_uppercase() || c == '_')).unwrap_or(rest.len());
            name > 0 && rest[name..].starts_with('@')
        })
    }

    #[test]
    fn every_placeholder_is_filled_in_either_kind_of_crate() {
        assert!(has_placeholder("a @NAME@ b") && !has_placeholder("me@host.org, @ x"));
        for trainable in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            for file in write("bigram", dir.path(), Path::new("host"), trainable).unwrap() {
                let text = std::fs::read_to_string(&file).unwrap();
                assert!(!has_placeholder(&text), "{}:\n{text}", file.display());
            }
            assert_eq!(dir.path().join("train.py").exists(), trainable);
            let manifest = std::fs::read_to_string(dir.path().join("demo.toml")).unwrap();
            assert_eq!(manifest.contains("artifact = \"trained\""), trainable, "{manifest}");
        }
    }
}
