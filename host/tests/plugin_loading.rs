//! Every way a plugin library can be bad gets its own one-line refusal, and one bad library
//! never stops the others.

mod common;

use std::fs;
use std::path::Path;

use common::{fixture, plugins_dir_with, workspace_plugin};
use host::plugin::load::{load, sha256_file, LoadError};
use host::plugin::{select, Registry, SelectError};
use kernels::os::files::set_mode;

fn refusal(path: &Path, pin: Option<&str>) -> String {
    let error = load(path, pin).expect_err("the library must be refused");
    let message = error.to_string();
    assert_eq!(message.lines().count(), 1, "not one line: {message}");
    message
}

#[test]
fn a_file_that_is_not_a_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("libgarbage.so");
    fs::write(&path, b"these bytes are no ELF file").unwrap();
    assert_eq!(refusal(&path, None), "not a shared library (no ELF header)");
}

#[test]
fn a_library_without_the_root_symbol() {
    let message = refusal(&fixture("runtime_probe"), None);
    assert!(message.starts_with("not a drafter plugin (no plugin root symbol"), "{message}");
}

#[test]
fn a_plugin_of_another_api_major() {
    let message = refusal(&fixture("future_api"), None);
    let expected = format!(
        "built for plugin API 2.0.0, this host speaks {}; rebuild it against plugin-api 1.x",
        plugin_api::API_VERSION
    );
    assert_eq!(message, expected);
}

#[test]
fn an_abi_layout_mismatch_is_summarised_and_the_dump_kept_for_verbose() {
    let error = load(&fixture("abi_mismatch"), None).unwrap_err();
    let message = error.to_string();
    assert_eq!(message.lines().count(), 1);
    assert!(
        message.starts_with(&format!(
            "ABI layout mismatch with plugin API {}: mismatched package",
            plugin_api::API_VERSION
        )),
        "{message}"
    );
    let detail = error.detail().expect("the full layout report");
    assert!(detail.lines().count() > 10, "{detail}");
}

#[test]
fn a_root_symbol_that_is_no_abi_stable_header_is_named_as_such() {
    let message = refusal(&fixture("foreign_root"), None);
    assert!(message.contains("its plugin root symbol is not an abi_stable library header"), "{message}");
    assert_eq!(message.lines().count(), 1, "{message}");
}

#[test]
fn a_panic_while_loading() {
    assert_eq!(refusal(&fixture("panic_at_load"), None), "the plugin panicked while loading");
}

#[test]
fn a_sha256_mismatch_is_found_before_the_library_is_opened() {
    let wrong = "0".repeat(64);
    let message = refusal(&workspace_plugin("ngram"), Some(&wrong));
    assert!(message.starts_with(&format!("sha256 mismatch: the manifest pins {wrong}, the file has ")), "{message}");
    // The pin is checked first: a library that would panic when loaded is never opened.
    assert!(refusal(&fixture("panic_at_load"), Some(&wrong)).starts_with("sha256 mismatch"));
    // The right pin loads.
    let pin = sha256_file(&workspace_plugin("ngram")).unwrap();
    assert_eq!(load(&workspace_plugin("ngram"), Some(&pin)).unwrap().descriptor.kind.as_str(), "ngram");
}

#[test]
fn a_library_or_directory_writable_by_others() {
    let dir = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let lib = dir.path().join("libngram.so");
    set_mode(&lib, 0o666).unwrap();
    let message = refusal(&lib, None);
    assert!(
        message.starts_with("the library ") && message.contains("is writable by group or others (mode 666)"),
        "{message}"
    );

    set_mode(&lib, 0o755).unwrap();
    set_mode(dir.path(), 0o777).unwrap();
    let message = refusal(&lib, None);
    assert!(message.starts_with("its directory ") && message.contains("(mode 777)"), "{message}");
    set_mode(dir.path(), 0o700).unwrap();
}

#[test]
fn one_bad_library_never_stops_the_others() {
    let dir = plugins_dir_with(&[
        &fixture("future_api"),
        &fixture("panic_at_load"),
        &fixture("runtime_probe"),
        &fixture("abi_mismatch"),
        &workspace_plugin("ngram"),
        &fixture("misbehaving"),
    ]);
    fs::write(dir.path().join("libgarbage.so"), b"junk").unwrap();
    fs::write(dir.path().join("README.txt"), b"not a library, not looked at").unwrap();
    let registry = Registry::scan(dir.path()).unwrap();
    assert_eq!(registry.entries.len(), 7);
    let loaded: Vec<&str> = registry.loaded().map(|p| p.descriptor.kind.as_str()).collect();
    assert_eq!(loaded, ["misbehaving", "ngram"]);
    assert!(registry.find("ngram").is_some());
    let refused = registry.entries.iter().filter(|e| e.outcome.is_err()).count();
    assert_eq!(refused, 5);
}

#[test]
fn selecting_by_kind_and_by_pin() {
    let dir = plugins_dir_with(&[&workspace_plugin("ngram"), &fixture("future_api")]);
    assert_eq!(select(dir.path(), "ngram", None).unwrap().descriptor.kind.as_str(), "ngram");
    let missing = select(dir.path(), "dflash", None).unwrap_err();
    assert!(matches!(missing, SelectError::NoSuchKind { .. }));
    let message = missing.to_string();
    assert!(message.contains("no plugin of kind `dflash`") && message.contains("loaded kinds: ngram"), "{message}");
    assert!(message.contains("libfuture_api.so: built for plugin API 2.0.0"), "{message}");

    let pin = sha256_file(&dir.path().join("libngram.so")).unwrap();
    assert_eq!(
        select(dir.path(), "ngram", Some(&pin)).unwrap().path,
        dir.path().join("libngram.so").canonicalize().unwrap()
    );
    let wrong = select(dir.path(), "ngram", Some(&"a".repeat(64))).unwrap_err();
    assert!(matches!(wrong, SelectError::NoPinnedLibrary { .. }), "{wrong}");
    let wrong_kind = select(dir.path(), "assistant", Some(&pin)).unwrap_err();
    assert!(wrong_kind.to_string().contains("is of kind `ngram`, not `assistant`"), "{wrong_kind}");
}

#[test]
fn load_errors_are_distinct_variants() {
    assert!(matches!(load(&fixture("future_api"), None), Err(LoadError::ApiMajor { .. })));
    assert!(matches!(load(&fixture("abi_mismatch"), None), Err(LoadError::AbiMismatch { .. })));
    assert!(matches!(load(&fixture("panic_at_load"), None), Err(LoadError::PanicAtLoad)));
    assert!(matches!(load(&fixture("runtime_probe"), None), Err(LoadError::NotAPlugin)));
}
