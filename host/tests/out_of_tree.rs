//! A drafter crate outside the checkout (tests/out-of-tree, copied elsewhere) builds with
//! `cargo build` once `scripts/setup.sh --drafter-crate` wrote its cargo settings, passes the
//! conformance kit in its own tests, and drafts on the demo target with output identical to
//! plain decoding.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

/// Copies the template to `to`, its placeholders filled in.
fn write_crate(to: &Path) {
    let template = repo().join("tests/out-of-tree");
    let fill = |text: String| {
        text.replace("@PLUGIN_API@", repo().join("plugin-api").to_str().unwrap())
            .replace("@MODEL@", repo().join("models/kjv-gemma4").to_str().unwrap())
    };
    std::fs::create_dir_all(to.join("src")).unwrap();
    for (from, into) in [("Cargo.toml.in", "Cargo.toml"), ("demo.toml.in", "demo.toml"), ("src/lib.rs", "src/lib.rs")] {
        std::fs::write(to.join(into), fill(std::fs::read_to_string(template.join(from)).unwrap())).unwrap();
    }
}

/// Runs `command` in `dir`, without the variables cargo set for this test (the crate must build
/// as it would from a shell), and returns its stdout; panics with its output if it failed.
fn run(dir: &Path, command: &mut Command) -> String {
    for (key, _) in std::env::vars_os() {
        let set_by_cargo = |k: &str| k.starts_with("CARGO_") && k != "CARGO_HOME";
        if key.to_str().is_some_and(|k| set_by_cargo(k) || k == "RUSTFLAGS" || k == "RUSTDOCFLAGS") {
            command.env_remove(key);
        }
    }
    // One build directory across runs, outside the crate: a second run builds nothing new.
    command.env("CARGO_TARGET_DIR", repo().join("target/out-of-tree"));
    let out = command.current_dir(dir).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{command:?} failed in {}:\n{stdout}\n{stderr}", dir.display());
    format!("{stdout}{stderr}")
}

#[test]
fn a_drafter_outside_the_checkout_builds_passes_conformance_and_drafts_losslessly() {
    let home = tempfile::tempdir().unwrap();
    let krate = home.path().join("bigram");
    write_crate(&krate);
    let setup = repo().join("scripts/setup.sh");
    run(&krate, Command::new("bash").arg(&setup).args(["--drafter-crate", "."]));
    assert!(krate.join(".cargo/config.toml").exists());
    let cargo = env!("CARGO");
    run(&krate, Command::new(cargo).args(["build", "--release", "--quiet"]));
    let tests = run(&krate, Command::new(cargo).args(["test", "--release", "--quiet"]));
    assert!(tests.contains("1 passed"), "{tests}");

    let library = format!("{}bigram{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let plugins = home.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    std::fs::copy(repo().join("target/out-of-tree/release").join(&library), plugins.join(&library)).unwrap();
    let host = env!("CARGO_BIN_EXE_host");
    let listed = run(&krate, Command::new(host).args(["plugins", "list", "--plugins-dir"]).arg(&plugins));
    assert!(listed.contains("bigram") && listed.contains("loaded"), "{listed}");
    let report = run(
        &krate,
        Command::new(host).args(["run", "--manifest", "demo.toml", "--compare-plain", "--plugins-dir"]).arg(&plugins),
    );
    assert!(report.contains("output identical"), "{report}");
    assert!(!report.contains(" 0 drafted"), "{report}");
}
