//! Host and plugins share one MLX runtime: arrays cross both ways, one libmlx.so is mapped,
//! plugin errors keep their text, and compiled functions cannot collide.

mod common;

use std::sync::{Mutex, MutexGuard};

use abi_stable::std_types::{RResult, RString};
use libloading::{Library, Symbol};
use mlx_rs::ops::softmax_axis;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{random, Array};
use plugin_api::{ArrayRef, OwnedArray};

type ProbeFn = unsafe extern "C" fn(ArrayRef<'_>) -> RResult<OwnedArray, RString>;

/// MLX evaluation is not meant to be driven from several threads at once; tests take turns.
fn probe() -> (MutexGuard<'static, ()>, &'static Library) {
    static TURN: Mutex<()> = Mutex::new(());
    static PROBE: std::sync::OnceLock<Library> = std::sync::OnceLock::new();
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    host::runtime::init();
    let library = PROBE
        .get_or_init(|| unsafe { Library::new(common::fixture("runtime_probe")) }.expect("the runtime probe loads"));
    (turn, library)
}

fn call(library: &Library, name: &[u8], x: &Array) -> Result<Array, String> {
    let f: Symbol<ProbeFn> = unsafe { library.get(name) }.expect("probe symbol");
    match unsafe { f(ArrayRef::new(x)) } {
        RResult::ROk(owned) => Ok(owned.into_array()),
        RResult::RErr(message) => Err(message.into()),
    }
}

#[test]
fn plugin_computes_on_a_host_array_and_the_host_frees_the_result() {
    let (_turn, library) = probe();
    let key = random::key(7).unwrap();
    let x = random::normal::<f32>(&[4, 8], None, None, &key).unwrap();
    let from_plugin = call(library, b"probe_matmul_softmax", &x).unwrap();
    let expected = softmax_axis(x.matmul(x.t()).unwrap(), -1, None).unwrap();

    assert_eq!(from_plugin.shape(), &[4, 4]);
    let (got, want) = (from_plugin.as_slice::<f32>(), expected.as_slice::<f32>());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "plugin {g} vs host {w}");
    }
    let row_sum: f32 = got[..4].iter().sum();
    assert!((row_sum - 1.0).abs() < 1e-5);
    // The input is still the host's and intact after the plugin's reference was dropped.
    assert_eq!(x.shape(), &[4, 8]);
    drop(from_plugin);
}

#[test]
fn exactly_one_libmlx_is_mapped_with_a_plugin_loaded() {
    let (_turn, _library) = probe();
    let mapped = host::runtime::libmlx_paths().unwrap();
    assert_eq!(mapped.len(), 1, "libmlx.so mappings: {mapped:?}");
}

#[test]
fn an_mlx_error_inside_the_plugin_reaches_the_host_with_its_message() {
    let (_turn, library) = probe();
    let x = Array::from_slice(&[1.0f32; 6], &[2, 3]);
    let message = call(library, b"probe_mismatched_matmul", &x).unwrap_err();
    assert!(message.contains("[matmul]"), "message was: {message}");
    assert!(message.contains("(2,3)"), "message was: {message}");
}

#[test]
fn compiled_functions_of_host_and_plugin_do_not_collide() {
    let (_turn, library) = probe();
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
    let mut times_2 = compile(|x: &Array| x * 2.0f32, None);
    assert_eq!(times_2(&x).unwrap().as_slice::<f32>(), &[2.0, 4.0, 6.0]);
    let plus_100 = call(library, b"probe_compiled_add_100", &x).unwrap();
    assert_eq!(plus_100.as_slice::<f32>(), &[101.0, 102.0, 103.0]);
    assert_eq!(times_2(&x).unwrap().as_slice::<f32>(), &[2.0, 4.0, 6.0]);
}
