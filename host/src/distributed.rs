//! MLX's own distributed layer, as the tensor-parallel target uses it.
//!
//! The ring backend (TCP between ranks, the one `mlx.launch` and mlx-lm's sharded generation
//! use) is built into the libmlx this process loads; mlx-c exposes it. A process is a rank when
//! `host launch` (or `mlx.launch`) gave it the backend's own environment: `MLX_RANK` and
//! `MLX_HOSTFILE`, a JSON list with one list of `"ip:port"` addresses per rank. Collectives are
//! MLX ops: they join the graph and run when it is evaluated, on every rank in the same order.

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// The environment variables the ring backend reads.
pub const RANK_ENV: &str = "MLX_RANK";
pub const HOSTFILE_ENV: &str = "MLX_HOSTFILE";

#[derive(Debug, thiserror::Error)]
pub enum DistributedError {
    #[error("${RANK_ENV} = `{0}` is not a rank (a number from 0)")]
    Rank(String),
    #[error("${HOSTFILE_ENV} is set but ${RANK_ENV} is not: every rank needs its number")]
    NoRank,
    #[error("{file}: {reason}")]
    Hostfile { file: PathBuf, reason: String },
    #[error("this libmlx has no `{0}` distributed backend")]
    Unavailable(&'static str),
    #[error(
        "rank {rank} could not join the ring of {size} listed in {file} (a peer unreachable, or its address taken)"
    )]
    Join { rank: usize, size: usize, file: PathBuf },
}

/// This process's place among the ranks.
pub struct Group {
    raw: mlx_sys::mlx_distributed_group,
    pub rank: usize,
    pub size: usize,
}

// SAFETY: the group is an immutable handle to MLX's communication state, created once and never
// freed; MLX serializes the collectives it runs.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

static GROUP: OnceLock<Option<Group>> = OnceLock::new();

/// The ring this process belongs to, joined on first call from the backend's environment; `None`
/// for a single process.
pub fn group() -> Result<Option<&'static Group>, DistributedError> {
    if let Some(group) = GROUP.get() {
        return Ok(group.as_ref());
    }
    let joined = join_from_env()?;
    Ok(GROUP.get_or_init(|| joined).as_ref())
}

fn join_from_env() -> Result<Option<Group>, DistributedError> {
    let Some(file) = std::env::var_os(HOSTFILE_ENV).map(PathBuf::from) else { return Ok(None) };
    let rank = std::env::var(RANK_ENV).map_err(|_| DistributedError::NoRank)?;
    let rank: usize = rank.trim().parse().map_err(|_| DistributedError::Rank(rank))?;
    let size = read_hostfile(&file)?.len();
    if rank >= size {
        let reason = format!("lists {size} ranks, but this is rank {rank}");
        return Err(DistributedError::Hostfile { file, reason });
    }
    if size == 1 {
        return Ok(None);
    }
    let backend = CString::new("ring").expect("no NUL");
    // SAFETY: mlx_distributed_is_available only reads the name; mlx_distributed_init writes the
    // group handle, which is valid when it returns 0.
    unsafe {
        if !mlx_sys::mlx_distributed_is_available(backend.as_ptr()) {
            return Err(DistributedError::Unavailable("ring"));
        }
        let mut raw = mlx_sys::mlx_distributed_group_new();
        if mlx_sys::mlx_distributed_init(&mut raw, true, backend.as_ptr()) != 0 || raw.ctx.is_null() {
            return Err(DistributedError::Join { rank, size, file });
        }
        let joined = Group {
            rank: mlx_sys::mlx_distributed_group_rank(raw) as usize,
            size: mlx_sys::mlx_distributed_group_size(raw) as usize,
            raw,
        };
        Ok(Some(joined))
    }
}

/// The ranks' addresses from a ring hostfile: one list of `"ip:port"` per rank.
pub fn read_hostfile(file: &std::path::Path) -> Result<Vec<Vec<String>>, DistributedError> {
    let bad = |reason: String| DistributedError::Hostfile { file: file.to_owned(), reason };
    let text = std::fs::read_to_string(file).map_err(|e| bad(e.to_string()))?;
    let ranks: Vec<Vec<String>> = serde_json::from_str(&text)
        .map_err(|e| bad(format!("{e}; a ring hostfile is a JSON list of [\"ip:port\", …] lists, one per rank")))?;
    if ranks.is_empty() {
        return Err(bad("lists no ranks".into()));
    }
    for (rank, addresses) in ranks.iter().enumerate() {
        if addresses.is_empty() {
            return Err(bad(format!("rank {rank} has no address")));
        }
        for address in addresses {
            if address.rsplit_once(':').and_then(|(_, port)| port.parse::<u16>().ok()).is_none() {
                return Err(bad(format!("rank {rank}: `{address}` is not ip:port")));
            }
        }
    }
    Ok(ranks)
}

impl Group {
    /// The elementwise sum of `x` over all ranks (every rank passes the same shape).
    pub fn all_sum(&self, x: &Array) -> Result<Array, Exception> {
        self.collective(x, mlx_sys::mlx_distributed_all_sum, "all_sum")
    }

    /// Every rank's `x` concatenated along the first axis, in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array, Exception> {
        self.collective(x, mlx_sys::mlx_distributed_all_gather, "all_gather")
    }

    /// Rank 0's `bytes` on every rank (the other ranks' are ignored): a length, then the
    /// bytes, each summed over ranks to which the others add zeros.
    pub fn broadcast(&self, bytes: &[u8]) -> Result<Vec<u8>, Exception> {
        let mine = if self.rank == 0 { bytes } else { &[] };
        let len = self.all_sum(&Array::from_slice(&[mine.len() as i32], &[1]))?;
        let len = len.as_slice::<i32>()[0] as usize;
        if len == 0 {
            return Ok(Vec::new());
        }
        let data: Vec<u8> = if self.rank == 0 { mine.to_vec() } else { vec![0; len] };
        let summed = self.all_sum(&Array::from_slice(&data, &[len as i32]))?;
        Ok(summed.as_slice::<u8>().to_vec())
    }

    fn collective(
        &self,
        x: &Array,
        op: unsafe extern "C" fn(
            *mut mlx_sys::mlx_array,
            mlx_sys::mlx_array,
            mlx_sys::mlx_distributed_group,
            mlx_sys::mlx_stream,
        ) -> std::os::raw::c_int,
        name: &str,
    ) -> Result<Array, Exception> {
        // SAFETY: `x` and the group are valid handles; on success `res` holds a new array, which
        // Array::from_ptr takes ownership of. The CPU stream handle is freed after the call.
        unsafe {
            let stream = mlx_sys::mlx_default_cpu_stream_new();
            let mut res = mlx_sys::mlx_array_new();
            let status = op(&mut res, x.as_ptr(), self.raw, stream);
            mlx_sys::mlx_stream_free(stream);
            if status != 0 {
                mlx_sys::mlx_array_free(res);
                return Err(Exception::custom(format!("MLX distributed {name} failed on rank {}", self.rank)));
            }
            Ok(Array::from_ptr(res))
        }
    }
}
