//! Collective operations between the ranks of a tensor-parallel group: each rank holds a
//! slice of every layer's heads and MLP columns, and the partial sums of its output
//! products are added across the ranks.

use crate::{Backend, DType};
use std::sync::atomic::{AtomicBool, Ordering};

static ABORTED: AtomicBool = AtomicBool::new(false);

/// Whether a group of this process was aborted: NCCL's communicators may still be tearing
/// down on another thread, which the libraries' exit handlers must not run beside (on 2x
/// H200 with NCCL 2.28.3 they crashed the exit), so such a process ends without them.
pub fn any_aborted() -> bool {
    ABORTED.load(Ordering::Relaxed)
}

/// Records for [`any_aborted`] that a group is being aborted.
pub(crate) fn note_abort() {
    ABORTED.store(true, Ordering::Relaxed);
}

/// A rank's view of its group, queued on the rank's backend like its other ops.
///
/// A rank that fails calls [`Collective::abort`]: the other ranks' waiting collectives
/// then return at once (their results are garbage) and [`Collective::failure`] names the
/// cause, so a failed rank stops the group with its error instead of hanging it.
pub trait Collective<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;

    fn world_size(&self) -> usize;

    /// Sums the first `numel` elements of `buf` (of `dtype`) over the ranks, in place:
    /// every rank ends with the same sum, added in rank order.
    fn all_reduce_sum(&self, b: &B, buf: &mut B::Buffer, dtype: DType, numel: usize);

    /// Stops the group: collectives waiting now or later return without a result.
    fn abort(&self, why: &str);

    /// Why the group was stopped, once it was.
    fn failure(&self) -> Option<String>;
}
