//! A drafter crate outside the checkout, as `host new-drafter` writes it: `cargo build` and
//! `cargo test` pass in it untouched, the host loads the library, and it drafts on the demo
//! target with output identical to plain decoding.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

/// Runs `command` in `dir`, without the variables cargo set for this test (the crate must build
/// as it would from a shell), and returns its output; panics with it if the command failed.
fn run(dir: &Path, command: &mut Command) -> String {
    for (key, _) in std::env::vars_os() {
        let set_by_cargo = |k: &str| k.starts_with("CARGO_") && k != "CARGO_HOME";
        if key.to_str().is_some_and(|k| set_by_cargo(k) || k == "RUSTFLAGS" || k == "RUSTDOCFLAGS") {
            command.env_remove(key);
        }
    }
    let out = command.current_dir(dir).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{command:?} failed in {}:\n{stdout}\n{stderr}", dir.display());
    format!("{stdout}{stderr}")
}

#[test]
fn a_new_drafter_builds_outside_the_checkout_passes_its_tests_and_drafts_losslessly() {
    let home = tempfile::tempdir().unwrap();
    let krate = home.path().join("bigram");
    let host = env!("CARGO_BIN_EXE_host");
    run(home.path(), Command::new(host).args(["new-drafter", "bigram"]));
    let readme = std::fs::read_to_string(krate.join("README.md")).unwrap();
    assert!(readme.contains("cargo build --release") && readme.contains("--compare-plain"), "{readme}");

    // The MLX link settings are what setup.sh writes for a drafter crate.
    let config = krate.join(".cargo/config.toml");
    let written = std::fs::read_to_string(&config).unwrap();
    std::fs::remove_file(&config).unwrap();
    run(&krate, Command::new("bash").arg(repo().join("scripts/setup.sh")).args(["--drafter-crate", "."]));
    assert_eq!(std::fs::read_to_string(&config).unwrap(), written);

    // One build directory across runs (the crate's `target` links to it): a second run builds
    // nothing new.
    let builds = repo().join("target/out-of-tree");
    std::fs::create_dir_all(&builds).unwrap();
    kernels::os::files::symlink(&builds, krate.join("target")).unwrap();
    let cargo = env!("CARGO");
    run(&krate, Command::new(cargo).args(["build", "--release", "--quiet"]));
    let tests = run(&krate, Command::new(cargo).args(["test", "--release", "--quiet"]));
    assert!(tests.contains("2 passed"), "{tests}");

    // The README's commands: the manifest names target/release as its plugins directory.
    let library = format!("target/release/{}bigram{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let checked = run(&krate, Command::new(host).args(["plugins", "check", &library]));
    assert!(checked.contains("passed:"), "{checked}");
    let report = run(&krate, Command::new(host).args(["run", "--manifest", "demo.toml", "--compare-plain"]));
    assert!(report.contains("output identical"), "{report}");
    assert!(!report.contains(" 0 drafted"), "{report}");
}

#[test]
fn new_drafter_refuses_a_bad_name_and_a_directory_in_use() {
    let home = tempfile::tempdir().unwrap();
    let host = env!("CARGO_BIN_EXE_host");
    let out = Command::new(host).args(["new-drafter", "My-Drafter"]).current_dir(home.path()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("`My-Drafter` is not a drafter name"), "{err}");
    std::fs::write(home.path().join("notes.txt"), "mine").unwrap();
    let out =
        Command::new(host).args(["new-drafter", "bigram", "--dir", "."]).current_dir(home.path()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("exists and is not empty"), "{err}");
    assert_eq!(std::fs::read_dir(home.path()).unwrap().count(), 1, "nothing was written");
}
