//! A tensor-parallel group of GPUs in one process, joined by NCCL: one communicator per
//! device, each collective queued on its rank's stream (and captured into its CUDA
//! graphs like the kernels around it). Small all-reduces take the one-shot kernel over
//! peer memory instead (`peer_all_reduce.rs`) where the GPUs reach each other's memory.
//!
//! NCCL is opened here rather than through cudarc: cudarc looks for `libnccl.so` and
//! CUDA-versioned names, while NCCL installs (its Python wheel among them) ship
//! `libnccl.so.2`; and the six calls below are the whole of what ingot uses.

use super::peer_all_reduce::PeerMemory;
use super::{library, CudaBackend, CudaBuffer};
use crate::collective::Collective;
use crate::DType;
use anyhow::{anyhow, bail, ensure, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

type Comm = *mut c_void;
type NcclResult = c_int;

/// The NCCL entry points ingot calls.
struct Nccl {
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> NcclResult,
    comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    _lib: libloading::Library,
}

// `ncclDataType_t` and `ncclRedOp_t` values (nccl.h).
const NCCL_FLOAT16: c_int = 6;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;
const NCCL_SUM: c_int = 0;

fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| open().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| anyhow!("{e}"))
}

fn open() -> Result<Nccl> {
    library::load(&library::NCCL)?;
    // SAFETY: NCCL's initializers only; the symbols' types are those of nccl.h.
    unsafe {
        let lib = libloading::Library::new(library::NCCL[0])?;
        Ok(Nccl {
            comm_init_all: *lib.get(b"ncclCommInitAll\0")?,
            all_reduce: *lib.get(b"ncclAllReduce\0")?,
            comm_abort: *lib.get(b"ncclCommAbort\0")?,
            comm_destroy: *lib.get(b"ncclCommDestroy\0")?,
            get_version: *lib.get(b"ncclGetVersion\0")?,
            error_string: *lib.get(b"ncclGetErrorString\0")?,
            _lib: lib,
        })
    }
}

impl Nccl {
    fn check(&self, r: NcclResult, what: &str) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for every result code.
        let msg = unsafe { CStr::from_ptr((self.error_string)(r)) };
        bail!("NCCL {what}: {} (error {r})", msg.to_string_lossy())
    }
}

/// A communicator handle. NCCL takes calls on it from any thread, one at a time (its
/// rank's runner thread makes them), and `ncclCommAbort` from another thread while one is
/// blocked in it.
struct Handle(Comm);
// SAFETY: see above.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// The group's communicators, in rank order, its peer memory, and why it stopped, once it
/// did.
struct Group {
    nccl: &'static Nccl,
    comms: Vec<Handle>,
    peer: Option<PeerMemory>,
    failure: Mutex<Option<String>>,
}

impl Drop for Group {
    fn drop(&mut self) {
        let aborted = self
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if let Some(p) = &mut self.peer {
            p.release(aborted);
        }
        if aborted {
            return;
        }
        for c in &self.comms {
            // SAFETY: each handle came from `ncclCommInitAll` and is destroyed once, after
            // every rank (each holds the group) is gone.
            unsafe { (self.nccl.comm_destroy)(c.0) };
        }
    }
}

/// One rank of a group of GPUs.
pub struct NcclRank {
    group: Arc<Group>,
    rank: usize,
}

/// Joins `devices` with NCCL, `devices[r]` as rank `r`.
pub(super) fn group(devices: &[CudaBackend]) -> Result<Vec<Arc<dyn Collective<CudaBackend>>>> {
    let nccl = nccl()?;
    if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
        tracing::warn!("NCCL_NVLS_ENABLE is not 0: NCCL may take NVLink multicast memory");
    }
    let ordinals: Vec<c_int> = devices.iter().map(|d| d.ctx.ordinal() as c_int).collect();
    let mut distinct = ordinals.clone();
    distinct.sort_unstable();
    distinct.dedup();
    ensure!(
        distinct.len() == ordinals.len(),
        "a tensor-parallel group needs distinct GPUs, found {ordinals:?}"
    );
    let mut comms = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: one output handle per ordinal.
    let r = unsafe {
        (nccl.comm_init_all)(
            comms.as_mut_ptr(),
            ordinals.len() as c_int,
            ordinals.as_ptr(),
        )
    };
    nccl.check(r, &format!("joining GPUs {ordinals:?}"))?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { (nccl.get_version)(&mut version) };
    tracing::info!(
        "NCCL {}.{}.{} joins GPUs {ordinals:?}",
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    let comms: Vec<Handle> = comms.into_iter().map(Handle).collect();
    let peer = match PeerMemory::new(devices) {
        Ok(p) => p,
        Err(e) => {
            for c in &comms {
                // SAFETY: fresh communicators with nothing queued.
                unsafe { (nccl.comm_destroy)(c.0) };
            }
            return Err(e.context("setting up the one-shot all-reduce"));
        }
    };
    let group = Arc::new(Group {
        nccl,
        comms,
        peer,
        failure: Mutex::new(None),
    });
    Ok((0..devices.len())
        .map(|rank| {
            Arc::new(NcclRank {
                group: group.clone(),
                rank,
            }) as Arc<dyn Collective<CudaBackend>>
        })
        .collect())
}

impl NcclRank {
    fn enqueue_all_reduce(
        &self,
        b: &CudaBackend,
        buf: &mut CudaBuffer,
        dtype: DType,
        numel: usize,
    ) -> Result<()> {
        ensure!(
            buf.dtype == dtype && numel <= buf.numel,
            "all-reduce of {numel} {dtype} values over a buffer of {} {}",
            buf.numel,
            buf.dtype
        );
        let ty = match dtype {
            DType::F32 => NCCL_FLOAT32,
            DType::F16 => NCCL_FLOAT16,
            DType::BF16 => NCCL_BFLOAT16,
            other => bail!("no all-reduce of {other} activations"),
        };
        b.ctx.bind_to_thread()?;
        let g = &self.group;
        let bytes = dtype.bytes_for(numel);
        if let Some(p) = &g.peer {
            if let Some(blocks) = p.blocks(bytes) {
                return p.enqueue(b, self.rank, buf.ptr, dtype, bytes, blocks);
            }
        }
        let ptr = buf.ptr as *mut c_void;
        // SAFETY: in place over `numel` live elements of the buffer, on the rank's stream.
        let r = unsafe {
            (g.nccl.all_reduce)(
                ptr,
                ptr,
                numel,
                ty,
                NCCL_SUM,
                g.comms[self.rank].0,
                b.stream.cu_stream() as *mut c_void,
            )
        };
        g.nccl
            .check(r, &format!("all-reduce on rank {}", self.rank))
    }
}

impl Collective<CudaBackend> for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.comms.len()
    }

    /// The one-shot kernel adds each element in rank order in f32 and rounds once; NCCL's
    /// ring and tree sums give every rank the same bits too, added in an order NCCL picks
    /// (fixed for a group and a size).
    fn all_reduce_sum(&self, b: &CudaBackend, buf: &mut CudaBuffer, dtype: DType, numel: usize) {
        if self.failure().is_some() {
            return;
        }
        b.timed("all_reduce", || {
            self.enqueue_all_reduce(b, buf, dtype, numel)
        });
    }

    fn abort(&self, why: &str) {
        let g = &self.group;
        {
            let mut failure = g.failure.lock().unwrap_or_else(|e| e.into_inner());
            if failure.is_some() {
                return;
            }
            *failure = Some(format!("rank {}: {why}", self.rank));
        }
        // Ranks blocked in a collective that the failed rank never joins return with an
        // error instead of waiting for it. The aborts run on a thread of their own, which
        // nothing waits for: a rank failing at a step replayed from a CUDA graph hung its
        // group on 2x H200 (NCCL 2.28.3) while the abort ran on the failing rank's thread.
        // The ranks see the failure at once and stop; the process's exit ends what is left
        // on the devices.
        crate::collective::note_abort();
        if let Some(p) = &g.peer {
            p.abort();
        }
        let group = g.clone();
        let spawned = std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || {
                for c in &group.comms {
                    // SAFETY: see `Handle`; no collective is queued on an aborted
                    // communicator, as each checks `failure` first.
                    unsafe { (group.nccl.comm_abort)(c.0) };
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the NCCL abort: {e}");
        }
    }

    fn failure(&self) -> Option<String> {
        self.group
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
