//! Page-locked host words for [`HostBuffer`](crate::HostBuffer), and the event that says
//! when the device last finished reading them.

use anyhow::Result;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};
use std::sync::Arc;

pub struct PinnedWords {
    /// Owns the memory (freed on drop, after its own event, which nothing records).
    _slice: PinnedHostSlice<u32>,
    /// The slice's words, taken once: cudarc's accessors wait on its event each call.
    ptr: *mut u32,
    capacity: usize,
    /// Recorded on the stream after each upload from the words.
    read: CudaEvent,
}

// SAFETY: `ptr` points into `_slice`'s allocation, which lives as long as this; writes go
// through `&mut self`, and the device's reads are waited for before each.
unsafe impl Send for PinnedWords {}
unsafe impl Sync for PinnedWords {}

impl PinnedWords {
    pub fn new(ctx: &Arc<CudaContext>, capacity: usize) -> Result<PinnedWords> {
        let capacity = capacity.max(1);
        // Plain page-locked memory (flags 0), not cudarc's default write-combined: the host
        // also reads these words (a step's later mask rows are appended after them), and
        // write-combined memory is uncached for reads.
        // SAFETY: every word is written (zeroed) below before any is read.
        let mut slice = unsafe { ctx.alloc_pinned_with_flags::<u32>(capacity, 0)? };
        let words = slice.as_mut_slice()?;
        words.fill(0);
        let ptr = words.as_mut_ptr();
        let read = ctx.new_event(None)?;
        Ok(PinnedWords {
            _slice: slice,
            ptr,
            capacity,
            read,
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn words(&self) -> &[u32] {
        // SAFETY: `capacity` initialized words live at `ptr` as long as `self`; reads may
        // overlap the device's.
        unsafe { std::slice::from_raw_parts(self.ptr, self.capacity) }
    }

    /// The words, once the device has read the last upload from them.
    pub fn words_mut(&mut self) -> &mut [u32] {
        // A failed wait means the context failed: the device reads nothing more, and the
        // next op on the stream reports the error.
        let _ = self.read.synchronize();
        // SAFETY: as in `words`, and no upload reads them any more.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.capacity) }
    }

    /// Marks the end of an upload just enqueued on `stream`.
    pub fn uploaded(&self, stream: &CudaStream) -> Result<()> {
        self.read.record(stream)?;
        Ok(())
    }
}
