//! The process's MLX runtime: the rules every artifact follows, and what is actually loaded.

use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::Once;

use kernels::os::libraries;

/// Applies the process-wide MLX rules; call it before any MLX work (idempotent).
///
/// Compilation is disabled because mlx-rs numbers compiled functions per copy of mlx-rs while
/// the compile cache lives in the one shared libmlx: with host and plugins each holding a copy,
/// a plugin's compiled function could hit the host's cache entry and return its result. The
/// toolkit's fused op chains (`nn`'s `fused`) compile under ids of their own and switch it on
/// for their own calls only.
pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(mlx_rs::transforms::compile::disable_compile);
}

/// [`init`] for the `host` process, called first thing in `main` while it is the only thread:
/// on the CPU loops' route the main thread and MLX's CPU worker share one core, and the
/// kernels' helper threads get the others (see `kernels::cpus` for why). On MLX's route there
/// are no helpers, and MLX's worker computes while the main thread builds the next step: each
/// keeps the whole machine.
pub fn init_process() {
    let _ = PROCESS_CPUS.set(kernels::cpus::allowed());
    let sharing = kernels::route::on_cpu().then(kernels::cpus::share_one_core_with_mlx).flatten();
    if let Some(helpers) = sharing {
        // SAFETY: no other thread exists yet to read the environment concurrently.
        unsafe { std::env::set_var(kernels::cpus::HELPER_CPUS_ENV, helpers) };
    }
    if std::env::var_os(CUDNN_ATTENTION_ENV).is_none() {
        // SAFETY: as above; MLX reads it at its first attention on a GPU.
        unsafe { std::env::set_var(CUDNN_ATTENTION_ENV, "0") };
    }
    // MLX starts its worker with the first array it evaluates; it inherits this affinity.
    let _ = mlx_rs::Array::from_int(0).eval();
    init();
}

/// MLX's switch for cuDNN attention on CUDA, which the host turns off unless the user set it.
/// MLX 0.32 takes cuDNN for the attention of query rows that its own vector kernel does not
/// serve (verify windows, block drafters) and builds a new cuDNN graph whenever the keys grow,
/// so every verify round builds one, which costs the round far more than its attention
/// (docs/gpu.md). Without it, those rows take MLX's own kernels.
pub const CUDNN_ATTENTION_ENV: &str = "MLX_CUDA_USE_CUDNN_SDPA";

/// The cores this process was given, before [`init_process`] kept one for MLX's dispatch.
static PROCESS_CPUS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

/// The cores this process was given (all of them, not only the one its driving thread keeps).
pub fn process_cpus() -> Vec<usize> {
    PROCESS_CPUS.get().cloned().unwrap_or_else(kernels::cpus::allowed)
}

/// Runs `start` (which starts child processes) with the calling thread on `cpus`, then puts it
/// back on its own cores: children inherit the affinity of the thread that starts them, and
/// would otherwise share the one core the driving thread keeps. (Setting it in the child
/// instead, between fork and exec, makes the standard library fork the whole process rather
/// than spawn, which measurably slowed the parent's decoding afterwards.)
pub fn starting_children_on<T>(cpus: &[usize], start: impl FnOnce() -> T) -> T {
    let own = kernels::cpus::allowed();
    if cpus.is_empty() || cpus == own.as_slice() {
        return start();
    }
    kernels::cpus::pin(cpus);
    let started = start();
    kernels::cpus::pin(&own);
    started
}

/// [`starting_children_on`] every core this process was given.
pub fn starting_children<T>(start: impl FnOnce() -> T) -> T {
    starting_children_on(&process_cpus(), start)
}

/// The version of the libmlx loaded into this process, as it reports itself.
pub fn mlx_version() -> String {
    // SAFETY: mlx_version fills a fresh mlx_string, which is freed after copying its text.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        mlx_sys::mlx_version(&mut s);
        let version = CStr::from_ptr(mlx_sys::mlx_string_data(s)).to_string_lossy().into_owned();
        mlx_sys::mlx_string_free(s);
        version
    }
}

/// Bytes of the arrays MLX holds alive in this process (weights, caches, anything not yet
/// freed), not counting its buffer cache.
pub fn active_memory() -> usize {
    let mut bytes = 0usize;
    // SAFETY: mlx_get_active_memory writes one size_t.
    unsafe { mlx_sys::mlx_get_active_memory(&mut bytes) };
    bytes
}

/// The distinct MLX libraries loaded into this process (one, when all is well).
pub fn libmlx_paths() -> std::io::Result<Vec<PathBuf>> {
    Ok(libraries::loaded()?.into_iter().filter(|p| libraries::is_libmlx(p)).collect())
}

/// The BLAS that MLX's matrix products actually call.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Blas {
    /// "OpenBLAS <its build configuration>" where it says so, else the library's file name.
    pub name: String,
    /// The file providing `cblas_sgemm`, symbolic links resolved.
    pub path: PathBuf,
}

/// Finds the object that provides `cblas_sgemm` to the process, the symbol MLX's CPU matmul
/// calls, and names it: OpenBLAS by its build description where the library (or, for a thin
/// BLAS such as Debian's libblas.so.3, one it depends on) has `openblas_get_config`. Reads the
/// process rather than assuming what setup installed.
pub fn blas_in_use() -> Option<Blas> {
    let file = libraries::providing("cblas_sgemm")?;
    let name = libraries::text_of(&file, "openblas_get_config")
        .map(|config| format!("OpenBLAS {}", config.trim().trim_start_matches("OpenBLAS").trim()))
        .or_else(|| Some(file.file_name()?.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let path = std::fs::canonicalize(&file).unwrap_or(file);
    Some(Blas { name, path })
}
