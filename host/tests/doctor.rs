//! `host doctor --json` reads the runtime from the process: one libmlx, the BLAS it calls.

use std::process::Command;

#[test]
fn doctor_reports_the_runtime_as_json() {
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["doctor", "--json", "--plugins-dir", "/some/plugins"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    // What scripts/setup.sh installed (the wheel is a choice: MLX_WHEEL).
    let installed = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.native/installed.json");
    let installed: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&installed).unwrap()).unwrap();
    assert_eq!(report["mlx_version"], installed["mlx_version"]);
    let libmlx = report["libmlx_path"].as_array().unwrap();
    assert_eq!(libmlx.len(), 1);
    assert!(libmlx[0].as_str().unwrap().ends_with("/mlx/lib/libmlx.so"));
    // Where setup pointed the wheel's reference BLAS at OpenBLAS, the process must run on it.
    let blas = report["blas"].as_str().unwrap();
    if installed["blas"] == "OpenBLAS" {
        assert!(blas.starts_with("OpenBLAS "), "blas: {blas}");
    }
    assert!(report["device"].as_str().unwrap().contains(installed["device"].as_str().unwrap()), "{report}");
    assert_eq!(report["plugins_dir"], "/some/plugins");
    assert!(report["matmul_gflops"].as_f64().unwrap() > 0.0);
}

#[test]
fn plugins_dir_defaults_to_the_environment_then_the_executable_directory() {
    let run = |env: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_host"));
        cmd.args(["doctor", "--json"]).env_remove(host::plugins_dir::PLUGINS_DIR_ENV);
        if let Some(dir) = env {
            cmd.env(host::plugins_dir::PLUGINS_DIR_ENV, dir);
        }
        let out = cmd.output().unwrap();
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        report["plugins_dir"].as_str().unwrap().to_owned()
    };
    assert_eq!(run(Some("/from/env")), "/from/env");
    let exe_dir = std::path::Path::new(env!("CARGO_BIN_EXE_host")).parent().unwrap();
    assert_eq!(run(None), exe_dir.to_str().unwrap());
}
