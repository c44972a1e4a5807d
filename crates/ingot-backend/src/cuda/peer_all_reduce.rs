//! The one-shot all-reduce over peer memory (`kernels/all_reduce.cu`), for the messages of
//! decode steps (up to 1 MiB: 64 rows of Llama-3.1-70B): every rank reads all ranks' buffers
//! over NVLink in one kernel and sums them in rank order, as vLLM's custom all-reduce does.
//! On 2x H200 (2026-11-30, Llama-3.1-8B shapes at TP=2) decode ran 1.4-2.5% faster at batch
//! 1 and 2.8% at batch 64 than through NCCL (`docs/benchmarks.md`).
//!
//! The ranks are threads of one process, so a peer's device memory is addressed directly
//! once peer access is on: no IPC handles. Each rank has signal memory the others write
//! flags and buffer addresses into; an abort flag in mapped host memory lets a rank spinning
//! for a peer that failed return, as `ncclCommAbort` does for NCCL's kernels.

use super::CudaBackend;
use crate::DType;
use anyhow::{ensure, Context, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, DevicePtr};
use std::mem::ManuallyDrop;

/// Most ranks of a group (the kernel's `AR_MAX_RANKS`).
pub(super) const MAX_RANKS: usize = 8;
/// Most blocks one call runs; each has its own flags (`AR_MAX_BLOCKS`).
pub(super) const MAX_BLOCKS: usize = 64;
/// Threads of a block (`AR_THREADS`).
pub(super) const THREADS: usize = 256;
/// 16-byte vectors each thread sums and holds until all ranks have read them
/// (`AR_VECTORS`).
pub(super) const VECTORS: usize = 16;

/// Bytes of `ArSignal`: two flag arrays, the call counters, the buffer addresses.
const SIGNAL_BYTES: usize =
    MAX_BLOCKS * MAX_RANKS * 4 * 2 + MAX_BLOCKS * 4 + MAX_BLOCKS * MAX_RANKS * 8;

/// Largest message sent this way unless `INGOT_ONE_SHOT_MAX_BYTES` says otherwise (0:
/// NCCL for every message). At 64 KiB, batch-64 decode of 8B shapes (512 KiB messages, so
/// through NCCL) ran 11,359 tok/s against 11,702 at this limit.
const DEFAULT_MAX_BYTES: usize = 1 << 20;

/// `ArPeers`: every rank's signal memory, in rank order.
#[repr(C)]
#[derive(Clone, Copy)]
struct Peers {
    signal: [u64; MAX_RANKS],
}

/// The group's peer memory: each rank's signals and the shared abort flag.
pub(super) struct PeerMemory {
    /// Left to the process's exit once the group has failed, as a kernel may still spin on
    /// them.
    signals: ManuallyDrop<Vec<CudaSlice<u8>>>,
    peers: Peers,
    abort_host: *mut u32,
    /// The abort flag's address on each rank's device.
    abort_device: Vec<u64>,
    max_bytes: usize,
    /// Most blocks a call runs: one an SM of the smallest GPU, so all of a call's blocks
    /// are resident at once (each waits for its peers).
    most_blocks: usize,
}

// SAFETY: the host flag is written with volatile stores only, and read by the devices; the
// signals are device memory used by kernels on the ranks' streams.
unsafe impl Send for PeerMemory {}
unsafe impl Sync for PeerMemory {}

impl PeerMemory {
    /// Turns on peer access between all of `devices` and allocates the signals; `None`
    /// where a pair of GPUs cannot reach each other's memory or the one-shot path is
    /// switched off, and NCCL carries every message.
    pub(super) fn new(devices: &[CudaBackend]) -> Result<Option<PeerMemory>> {
        let max_bytes = match std::env::var("INGOT_ONE_SHOT_MAX_BYTES") {
            Ok(v) => v
                .parse()
                .with_context(|| format!("INGOT_ONE_SHOT_MAX_BYTES={v} is not a byte count"))?,
            Err(_) => DEFAULT_MAX_BYTES,
        };
        if max_bytes == 0 || devices.len() < 2 {
            return Ok(None);
        }
        ensure!(
            devices.len() <= MAX_RANKS,
            "the one-shot all-reduce joins at most {MAX_RANKS} GPUs, not {}",
            devices.len()
        );
        for a in devices {
            for b in others(devices, a) {
                let mut can = 0;
                // SAFETY: plain out-parameter; both devices exist.
                unsafe {
                    sys::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device())
                }
                .result()?;
                if can == 0 {
                    tracing::info!(
                        "cuda:{} cannot read cuda:{}'s memory: NCCL carries every all-reduce",
                        a.ctx.ordinal(),
                        b.ctx.ordinal()
                    );
                    return Ok(None);
                }
            }
        }
        for a in devices {
            a.ctx.bind_to_thread()?;
            for b in others(devices, a) {
                // SAFETY: `a`'s context is current; `b`'s is live.
                let r = unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) };
                if r != sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                    r.result()
                        .with_context(|| format!("peer access from {} to {}", a.name, b.name))?;
                }
            }
        }
        // Buffers come from each device's stream-ordered memory pool, which peer access
        // alone does not open to the other devices.
        for a in devices {
            if !a.ctx.has_async_alloc() {
                continue;
            }
            let mut pool = std::ptr::null_mut();
            // SAFETY: plain out-parameter of a live device.
            unsafe { sys::cuDeviceGetMemPool(&mut pool, a.ctx.cu_device()) }.result()?;
            let access: Vec<sys::CUmemAccessDesc> = others(devices, a)
                .map(|b| sys::CUmemAccessDesc {
                    location: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: b.ctx.ordinal() as i32,
                    },
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                })
                .collect();
            // SAFETY: `access` holds one descriptor per peer.
            unsafe { sys::cuMemPoolSetAccess(pool, access.as_ptr(), access.len()) }
                .result()
                .with_context(|| format!("opening {}'s memory pool to its peers", a.name))?;
        }
        let mut signals = Vec::with_capacity(devices.len());
        let mut peers = Peers {
            signal: [0; MAX_RANKS],
        };
        for (rank, d) in devices.iter().enumerate() {
            let s = d.stream.alloc_zeros::<u8>(SIGNAL_BYTES)?;
            peers.signal[rank] = s.device_ptr(&d.stream).0;
            signals.push(s);
        }
        let mut host = std::ptr::null_mut();
        devices[0].ctx.bind_to_thread()?;
        // SAFETY: a 4-byte allocation, mapped into every context (portable).
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                4,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        }
        .result()
        .context("allocating the all-reduce's abort flag")?;
        let abort_host = host.cast::<u32>();
        // SAFETY: the allocation above.
        unsafe { abort_host.write_volatile(0) };
        let mut abort_device = Vec::with_capacity(devices.len());
        for d in devices {
            d.ctx.bind_to_thread()?;
            let mut p = 0;
            // SAFETY: `host` is a mapped allocation.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut p, host, 0) }.result()?;
            abort_device.push(p);
        }
        // The signals are zeroed on their own rank's stream, but written by the peers'
        // kernels, which that stream does not order.
        for d in devices {
            d.stream.synchronize()?;
        }
        tracing::info!(
            "one-shot all-reduce over peer memory for messages up to {max_bytes} bytes; \
             NCCL above"
        );
        Ok(Some(PeerMemory {
            signals: ManuallyDrop::new(signals),
            peers,
            abort_host,
            abort_device,
            max_bytes,
            most_blocks: devices
                .iter()
                .map(|d| d.sm_count as usize)
                .min()
                .unwrap_or(1)
                .min(MAX_BLOCKS),
        }))
    }

    /// The blocks a call over `bytes` runs, if this path takes it: whole 16-byte vectors,
    /// within the size limit and what the blocks can hold. It depends on the size alone,
    /// so every rank of a call decides alike.
    pub(super) fn blocks(&self, bytes: usize) -> Option<u32> {
        if bytes == 0 || bytes > self.max_bytes || !bytes.is_multiple_of(16) {
            return None;
        }
        let vectors = bytes / 16;
        let blocks = vectors.div_ceil(THREADS).min(self.most_blocks);
        (vectors <= blocks * THREADS * VECTORS).then_some(blocks as u32)
    }

    /// Enqueues the sum of the first `bytes` of `ptr` (of `dtype`) over the ranks on rank
    /// `rank`'s stream, in `blocks` blocks (from [`PeerMemory::blocks`], the same on every
    /// rank for the same call).
    pub(super) fn enqueue(
        &self,
        b: &CudaBackend,
        rank: usize,
        ptr: u64,
        dtype: DType,
        bytes: usize,
        blocks: u32,
    ) -> Result<()> {
        // Allocations start 256-byte aligned, and every buffer reduced is a whole one.
        ensure!(
            ptr.is_multiple_of(16),
            "all-reduce of a buffer at {ptr:#x}, not 16-byte aligned"
        );
        let f = b
            .kernels
            .get(&format!("all_reduce_one_shot_{}", super::suffix(dtype)));
        let (mut peers, mut rank_i, mut world) =
            (self.peers, rank as i32, self.abort_device.len() as i32);
        let (mut buf, mut vectors, mut abort) = (ptr, (bytes / 16) as i64, self.abort_device[rank]);
        let mut params = [
            &mut peers as *mut Peers as *mut std::ffi::c_void,
            &mut rank_i as *mut i32 as *mut std::ffi::c_void,
            &mut world as *mut i32 as *mut std::ffi::c_void,
            &mut buf as *mut u64 as *mut std::ffi::c_void,
            &mut vectors as *mut i64 as *mut std::ffi::c_void,
            &mut abort as *mut u64 as *mut std::ffi::c_void,
        ];
        // SAFETY: the parameters match `all_reduce_one_shot_*`; `ptr` holds `bytes` on this
        // rank, and every rank makes the same call with its own buffer.
        unsafe { b.launch_kernel(&f, (blocks, 1, 1), THREADS as u32, 0, &mut params) }
    }

    /// Makes kernels waiting for a peer return; their results are garbage.
    pub(super) fn abort(&self) {
        // SAFETY: the flag lives until the group is dropped.
        unsafe { self.abort_host.write_volatile(1) };
    }

    /// Frees the signals and the flag, unless the group failed: then a kernel may still
    /// read them, and the process's exit frees them.
    pub(super) fn release(&mut self, failed: bool) {
        if failed {
            return;
        }
        // SAFETY: called once, from the group's drop, after every rank's stream is done
        // with the group.
        unsafe {
            ManuallyDrop::drop(&mut self.signals);
            sys::cuMemFreeHost(self.abort_host.cast());
        }
    }
}

/// The devices of `devices` other than `a`.
fn others<'a>(
    devices: &'a [CudaBackend],
    a: &'a CudaBackend,
) -> impl Iterator<Item = &'a CudaBackend> {
    devices
        .iter()
        .filter(move |b| b.ctx.ordinal() != a.ctx.ordinal())
}
