//! Waiting for MLX. A wait is a round trip: the host stops until the device has computed what it
//! asked for, and on a GPU the device then idles until the host queues more. The decode loops
//! wait as seldom as their algorithm allows (docs/gpu.md says how often): every wait they make
//! goes through [`eval`], which counts it on the calling thread, so that tests can hold each
//! loop to its count.

use std::cell::Cell;

use mlx_rs::error::Exception;
use mlx_rs::Array;

thread_local! {
    static WAITS: Cell<usize> = const { Cell::new(0) };
}

/// Computes `arrays` and waits for them: one wait.
pub fn eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<(), Exception> {
    WAITS.with(|w| w.set(w.get() + 1));
    mlx_rs::transforms::eval(arrays)
}

/// How many times this thread has waited through [`eval`].
pub fn waits() -> usize {
    WAITS.with(Cell::get)
}

/// MLX's printout of the ops still to run to compute `a`: an array already computed prints as
/// one input, since MLX drops an array's graph once it is computed. Tests read it to show that a
/// step was queued rather than waited for.
pub fn graph(a: &Array) -> String {
    extern "C" {
        fn fopen(path: *const std::ffi::c_char, mode: *const std::ffi::c_char) -> *mut mlx_sys::FILE;
        fn fclose(file: *mut mlx_sys::FILE) -> i32;
    }
    let name = format!("nn-graph-{}-{:?}.txt", std::process::id(), std::thread::current().id());
    let path = std::env::temp_dir().join(name);
    let c_path = std::ffi::CString::new(path.to_str().expect("a UTF-8 temporary directory")).expect("no NUL");
    // SAFETY: the file is opened and closed here; the vector is freed after the call.
    unsafe {
        let file = fopen(c_path.as_ptr(), c"w".as_ptr());
        assert!(!file.is_null(), "cannot write {}", path.display());
        let outputs = mlx_sys::mlx_vector_array_new_value(a.as_ptr());
        mlx_sys::mlx_print_graph(file, mlx_sys::mlx_node_namer_new(), outputs);
        mlx_sys::mlx_vector_array_free(outputs);
        fclose(file);
    }
    let printed = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    printed
}
