//! A drafter crate outside the checkout, as `host new-drafter --trainable` writes it: `cargo
//! build` and `cargo test` pass in it untouched, the host loads the library, and it drafts on the
//! demo target with output identical to plain decoding, without its artifact and with the one
//! its `train.py` fits to the demo target.

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

/// Writes the crate `name` (trainable or not) in `home`, checks its MLX link settings and
/// builds it into the build directory every run shares (the crate's `target` links to it).
fn scaffold(home: &Path, name: &str, trainable: bool) -> PathBuf {
    let krate = home.join(name);
    let host = env!("CARGO_BIN_EXE_host");
    let flag: &[&str] = if trainable { &["--trainable"] } else { &[] };
    run(home, Command::new(host).args(["new-drafter", name]).args(flag));
    let readme = std::fs::read_to_string(krate.join("README.md")).unwrap();
    assert!(readme.contains("cargo build --release") && readme.contains("--compare-plain"), "{readme}");
    assert_eq!(readme.contains("train.py"), trainable, "{readme}");

    // The MLX link settings are what setup.sh writes for a drafter crate.
    let config = krate.join(".cargo/config.toml");
    let written = std::fs::read_to_string(&config).unwrap();
    std::fs::remove_file(&config).unwrap();
    run(&krate, Command::new("bash").arg(repo().join("scripts/setup.sh")).args(["--drafter-crate", "."]));
    assert_eq!(std::fs::read_to_string(&config).unwrap(), written);

    let builds = repo().join("target/out-of-tree");
    std::fs::create_dir_all(&builds).unwrap();
    kernels::os::files::symlink(&builds, krate.join("target")).unwrap();
    run(&krate, Command::new(env!("CARGO")).args(["build", "--release", "--quiet"]));
    krate
}

/// What `command` said in `dir`, where it must fail.
fn refused(dir: &Path, command: &mut Command) -> String {
    let out = command.current_dir(dir).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "{command:?} passed in {}:\n{said}", dir.display());
    said
}

fn library(name: &str) -> String {
    format!("target/release/{}{name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}

#[test]
fn a_new_drafter_builds_outside_the_checkout_passes_its_tests_and_drafts_losslessly() {
    let home = tempfile::tempdir().unwrap();
    let krate = scaffold(home.path(), "bigram", false);
    let host = env!("CARGO_BIN_EXE_host");
    let tests = run(&krate, Command::new(env!("CARGO")).args(["test", "--release", "--quiet"]));
    assert!(tests.contains("4 passed"), "{tests}");

    // The README's commands: the manifest names target/release as its plugins directory.
    let checked = run(&krate, Command::new(host).args(["plugins", "check", &library("bigram")]));
    assert!(checked.contains("passed:"), "{checked}");
    let report = run(&krate, Command::new(host).args(["run", "--manifest", "demo.toml", "--compare-plain"]));
    assert!(report.contains("output identical"), "{report}");
    assert!(!report.contains(" 0 drafted"), "{report}");

    // The drafter takes no artifact, and says so.
    let said = refused(&krate, Command::new(host).args(["plugins", "check", &library("bigram"), "--artifact", "."]));
    assert!(said.contains("drafter `bigram` takes no artifact"), "{said}");
}

#[test]
fn a_trainable_drafter_trains_on_the_targets_signal_and_drafts_losslessly_with_its_artifact() {
    let home = tempfile::tempdir().unwrap();
    // Named apart from the other test's crate, which shares the build directory.
    let krate = scaffold(home.path(), "learned", true);
    let host = env!("CARGO_BIN_EXE_host");
    let tests = run(&krate, Command::new(env!("CARGO")).args(["test", "--release", "--quiet"]));
    assert!(tests.contains("4 passed"), "{tests}");

    // Without its artifact the drafter is refused by name, before anything runs.
    let said = refused(&krate, Command::new(host).args(["plugins", "check", &library("learned")]));
    assert!(said.contains("drafter `learned` needs an artifact"), "{said}");

    // The README's training command at the tiny preset, the signal cached in the crate.
    let python = repo().join("training/.venv/bin/python");
    assert!(python.exists(), "{} is missing: `bash training/setup.sh` makes it", python.display());
    let trained = run(&krate, Command::new(&python).args(["train.py", "--preset", "tiny", "--data", "signal"]));
    assert!(trained.contains("\"held_out_agreement\""), "{trained}");
    let checked =
        run(&krate, Command::new(host).args(["plugins", "check", &library("learned"), "--artifact", "trained"]));
    assert!(checked.contains("passed:") && checked.contains("learned-0-trained"), "{checked}");
    let report = run(&krate, Command::new(host).args(["run", "--manifest", "demo.toml", "--compare-plain"]));
    assert!(report.contains("output identical"), "{report}");
    assert!(!report.contains(" 0 drafted"), "{report}");

    // A table trained for another vocabulary is refused when the provider opens on the target.
    let small = "import mlx.core as mx; mx.save_safetensors('small/next_tokens.safetensors', {'next_token': mx.array([1, 0, -1])})";
    std::fs::create_dir(krate.join("small")).unwrap();
    run(&krate, Command::new(&python).args(["-c", small]));
    let said =
        refused(&krate, Command::new(host).args(["plugins", "check", &library("learned"), "--artifact", "small"]));
    assert!(said.contains("table has 3 tokens and the target's vocabulary 8192"), "{said}");
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
