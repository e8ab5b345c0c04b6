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
