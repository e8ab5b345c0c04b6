//! `host plugins check`: a good library passes every check against the demo target; a library
//! that breaks the contract fails, naming the check and the host's reason; exit 0 only on a pass.

mod common;

use std::process::{Command, Output};

use common::{fixture, workspace_plugin};

fn check(library: &std::path::Path, options: &str, json: bool) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_host"));
    command.args(["plugins", "check"]).arg(library).args(["--options", options]);
    if json {
        command.arg("--json");
    }
    command.output().unwrap()
}

#[test]
fn a_good_drafter_passes_every_check_and_gets_measured() {
    let out = check(&workspace_plugin("ngram"), "", true);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let checks = report["checks"].as_array().unwrap();
    assert!(checks.len() >= 10 && checks.iter().all(|c| c["passed"] == true), "{report}");
    for name in [
        "load",
        "open",
        "greedy, 6 draft tokens, prompt 2",
        "rows joining and leaving a batch mid-flight",
        "a prompt extending a cached one (row state captured, then restored)",
    ] {
        assert!(checks.iter().any(|c| c["check"] == name), "no check `{name}`: {report}");
    }
    let contract = checks.iter().filter(|c| c["check"].as_str().unwrap().starts_with("contract: ")).count();
    assert!(contract >= 5, "the conformance kit's checks through the library's ABI: {report}");
    assert!(report["measurement"]["tokens_per_forward"].as_f64().unwrap() > 1.0, "{report}");
}

#[test]
fn a_drafter_breaking_the_contract_fails_naming_the_check_and_the_reason() {
    for (mode, reason) in
        [("panic-in-draft", "panics in draft as asked"), ("too-many", "tokens"), ("out-of-vocab", "vocabulary")]
    {
        let out = check(&fixture("misbehaving"), &format!("mode = \"{mode}\""), false);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{mode}: passed\n{stdout}");
        let failed = stdout.lines().find(|l| l.contains("FAIL greedy, 1 draft tokens, prompt 0")).unwrap_or("");
        assert!(failed.contains("the host dropped the drafter") && failed.contains(reason), "{mode}:\n{stdout}");
        assert!(
            stdout.contains("FAILED:") && stderr.contains("did not pass every check"),
            "{mode}:\n{stdout}\n{stderr}"
        );
    }
}

#[test]
fn a_file_that_is_no_plugin_fails_its_load_check() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("libnothing.so");
    std::fs::write(&path, b"not a library").unwrap();
    let out = check(&path, "", false);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && stdout.contains("FAIL load: not a shared library"), "{stdout}");
}
