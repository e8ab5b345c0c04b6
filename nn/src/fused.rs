//! Chains of elementwise ops compiled by MLX into one kernel, as mlx-lm compiles its
//! activations and the logits' softcap. On MLX's route every op is a launch on a GPU and a task
//! on the CPU's stream: a GeGLU of a dozen ops costs a dozen. Compiled shapeless, a chain is
//! traced once per dtype and fused for every shape after.
//!
//! A compiled chain rounds each intermediate value to the dtype its op would give (MLX's code
//! for fused kernels keeps every op's output type), so it computes what the ops one by one do.
//! `MLX_DISABLE_COMPILE=1` runs them one by one (MLX's own switch).
//!
//! Why not mlx-rs's `compile`: MLX keeps compiled traces in one cache per process under an id
//! the caller picks, and mlx-rs numbers its compiled functions 1, 2, … per copy of mlx-rs. The
//! host and every plugin hold their own copy, so two of them would share ids and one could run
//! the other's trace; the host therefore keeps MLX's compilation off in the whole process. Here
//! a chain's id is its code address, which no other chain in the process has (the host never
//! unloads a plugin), and a chain switches compilation on for its own call only.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use mlx_rs::error::Exception;
use mlx_rs::Array;
use mlx_sys::{mlx_array, mlx_closure, mlx_vector_array};

/// A chain of ops over its inputs, giving one output.
pub type Chain = fn(&[Array]) -> Result<Vec<Array>, Exception>;

/// A compiled chain: MLX's closure, freed with the thread that made it.
struct Compiled(mlx_closure);

impl Drop for Compiled {
    fn drop(&mut self) {
        // SAFETY: the closure was made by `compiled` and is freed once, here.
        unsafe { mlx_sys::mlx_closure_free(self.0) };
    }
}

thread_local! {
    /// Each chain's compiled closure, by the chain's address.
    static COMPILED: RefCell<HashMap<usize, Compiled>> = RefCell::new(HashMap::new());
}

/// `chain` over `inputs`, compiled.
pub fn fused(chain: Chain, inputs: &[Array]) -> Result<Array, Exception> {
    if !compile_allowed() {
        return chain(inputs).map(|mut outputs| outputs.swap_remove(0));
    }
    let _on = CompilationOn::new();
    COMPILED.with(|cache| {
        let mut cache = cache.borrow_mut();
        let closure = match cache.entry(chain as usize) {
            Entry::Occupied(known) => known.get().0,
            Entry::Vacant(new) => new.insert(compiled(chain)?).0,
        };
        apply(closure, inputs)
    })
}

/// Whether the user left MLX's compilation allowed (`MLX_DISABLE_COMPILE` unset).
fn compile_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var_os("MLX_DISABLE_COMPILE").is_none())
}

/// MLX's compilation switched on while any chain of this copy of the toolkit runs, off after:
/// the process's rule outside chains.
struct CompilationOn;

/// Chains of this copy running now, on any thread.
static RUNNING: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

impl CompilationOn {
    fn new() -> CompilationOn {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        if *running == 0 {
            // SAFETY: sets MLX's global switch; no arrays involved.
            unsafe { mlx_sys::mlx_enable_compile() };
        }
        *running += 1;
        CompilationOn
    }
}

impl Drop for CompilationOn {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        *running -= 1;
        if *running == 0 {
            // SAFETY: as above.
            unsafe { mlx_sys::mlx_disable_compile() };
        }
    }
}

/// MLX's compiled form of `chain`, under the chain's address.
fn compiled(chain: Chain) -> Result<Compiled, Exception> {
    // SAFETY: the payload is `chain`, a function pointer that lives as long as the process and
    // that `run_chain` turns back into one; MLX copies what it keeps of the closure.
    unsafe {
        let traced = mlx_sys::mlx_closure_new_func_payload(Some(run_chain), chain as *mut c_void, None);
        let mut compiled = mlx_sys::mlx_closure_new();
        let status = mlx_sys::mlx_detail_compile(&mut compiled, traced, chain as usize, true, std::ptr::null(), 0);
        mlx_sys::mlx_closure_free(traced);
        match status {
            0 => Ok(Compiled(compiled)),
            _ => {
                mlx_sys::mlx_closure_free(compiled);
                Err(Exception::custom("MLX could not compile an op chain"))
            }
        }
    }
}

/// Runs a compiled closure on `inputs`, giving its one output.
fn apply(closure: mlx_closure, inputs: &[Array]) -> Result<Array, Exception> {
    let handles: Vec<mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
    // SAFETY: the vectors hold references of their own to valid arrays and are freed here; the
    // output taken from `out` is a new reference that the returned Array owns.
    unsafe {
        let args = mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len());
        let mut out = mlx_sys::mlx_vector_array_new();
        let status = mlx_sys::mlx_closure_apply(&mut out, closure, args);
        mlx_sys::mlx_vector_array_free(args);
        let result = match status == 0 && mlx_sys::mlx_vector_array_size(out) == 1 {
            true => {
                let mut first = mlx_sys::mlx_array_new();
                mlx_sys::mlx_vector_array_get(&mut first, out, 0);
                Ok(Array::from_ptr(first))
            }
            false => Err(Exception::custom("an op chain compiled by MLX failed")),
        };
        mlx_sys::mlx_vector_array_free(out);
        result
    }
}

/// What MLX calls to trace a chain: its inputs in, its outputs out; nonzero on an error (or a
/// panic, which must not cross into C++).
unsafe extern "C" fn run_chain(out: *mut mlx_vector_array, inputs: mlx_vector_array, payload: *mut c_void) -> c_int {
    // SAFETY: `compiled` made the payload from a `Chain`.
    let chain: Chain = unsafe { std::mem::transmute::<*mut c_void, Chain>(payload) };
    let run = || -> Result<(), Exception> {
        // SAFETY: `inputs` is MLX's valid vector for this call; each element read is a new
        // reference that its Array owns; `out` is MLX's vector to fill, which takes references
        // of its own.
        unsafe {
            let arrays: Vec<Array> = (0..mlx_sys::mlx_vector_array_size(inputs))
                .map(|i| {
                    let mut a = mlx_sys::mlx_array_new();
                    mlx_sys::mlx_vector_array_get(&mut a, inputs, i);
                    Array::from_ptr(a)
                })
                .collect();
            let outputs = chain(&arrays)?;
            let handles: Vec<mlx_array> = outputs.iter().map(|a| a.as_ptr()).collect();
            mlx_sys::mlx_vector_array_set_data(out, handles.as_ptr(), handles.len());
        }
        Ok(())
    };
    match std::panic::catch_unwind(run) {
        Ok(Ok(())) => 0,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::graph;

    /// Outside chains MLX's compilation is off again, so mlx-rs's compiled functions run as
    /// they are written (the process's rule).
    #[test]
    fn compilation_is_off_outside_chains() {
        let x = Array::from_slice(&[1.0f32, 2.0], &[2]);
        let chain: Chain = |x| Ok(vec![x[0].exp()?.add(&x[0])?]);
        assert!(graph(&fused(chain, std::slice::from_ref(&x)).unwrap()).contains("Compiled"));
        let mut plain = mlx_rs::transforms::compile::compile(|x: &Array| x.exp()?.add(x), None);
        // No chain may start or end meanwhile; wait for those of other tests to end.
        let running = loop {
            let running = RUNNING.lock().unwrap();
            if *running == 0 {
                break running;
            }
            drop(running);
            std::thread::yield_now();
        };
        let outside = graph(&plain(&x).unwrap());
        drop(running);
        assert!(!outside.contains("Compiled"), "{outside}");
    }
}
