//! A tensor-parallel group of CPU backends in one process: ranks meet in host memory.
//! It runs the sharded model on machines without GPUs, so the sharding is tested where
//! the GPU collectives cannot be.

use super::CpuBuffer;
use crate::collective::Collective;
use crate::{Backend, DType};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// What the ranks share: each rank's contribution to the collective under way.
pub struct HostGroup {
    size: usize,
    state: Mutex<State>,
    turn: Condvar,
}

struct State {
    slots: Vec<Vec<f32>>,
    arrived: usize,
    /// Counts completed barriers, so that a rank woken late knows its barrier passed.
    generation: u64,
    failure: Option<String>,
}

impl HostGroup {
    /// The ranks of a new group of `size`, in rank order.
    pub fn ranks(size: usize) -> Vec<HostRank> {
        let group = Arc::new(HostGroup {
            size,
            state: Mutex::new(State {
                slots: vec![vec![]; size],
                arrived: 0,
                generation: 0,
                failure: None,
            }),
            turn: Condvar::new(),
        });
        (0..size)
            .map(|rank| HostRank {
                group: group.clone(),
                rank,
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every rank has arrived; `false` when the group was stopped instead.
    fn barrier(&self) -> bool {
        let mut s = self.lock();
        if s.failure.is_some() {
            return false;
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.size {
            s.arrived = 0;
            s.generation += 1;
            self.turn.notify_all();
            return true;
        }
        while s.generation == generation && s.failure.is_none() {
            s = self.turn.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.failure.is_none()
    }
}

/// One rank of a [`HostGroup`].
pub struct HostRank {
    group: Arc<HostGroup>,
    rank: usize,
}

impl<B: Backend<Buffer = CpuBuffer>> Collective<B> for HostRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.size
    }

    fn all_reduce_sum(&self, _b: &B, buf: &mut CpuBuffer, dtype: DType, numel: usize) {
        assert_eq!(dtype, DType::F32, "CPU activations are f32");
        let g = &self.group;
        let mine = &mut buf.f32_mut()[..numel];
        {
            let mut s = g.lock();
            let slot = &mut s.slots[self.rank];
            slot.clear();
            slot.extend_from_slice(mine);
        }
        if !g.barrier() {
            return;
        }
        {
            let s = g.lock();
            mine.copy_from_slice(&s.slots[0]);
            for slot in &s.slots[1..] {
                for (m, &x) in mine.iter_mut().zip(slot) {
                    *m += x;
                }
            }
        }
        // Nobody refills a slot before every rank has read them all.
        g.barrier();
    }

    fn abort(&self, why: &str) {
        crate::collective::note_abort();
        let mut s = self.group.lock();
        s.failure
            .get_or_insert_with(|| format!("rank {}: {why}", self.rank));
        self.group.turn.notify_all();
    }

    fn failure(&self) -> Option<String> {
        self.group.lock().failure.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::HostGroup;
    use crate::collective::Collective;
    use crate::cpu::CpuBackend;
    use crate::{Backend, DType};

    #[test]
    fn ranks_end_with_the_same_sum_and_an_abort_releases_them() {
        let b = CpuBackend::new(Some(1)).unwrap();
        let ranks = HostGroup::ranks(3);
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|r| {
                    let b = &b;
                    s.spawn(move || {
                        let mut buf = b.alloc(DType::F32, 5).unwrap();
                        let rank = Collective::<CpuBackend>::rank(r) as f32;
                        let vals: Vec<f32> = (0..5).map(|i| rank * 10.0 + i as f32).collect();
                        b.upload(&mut buf, bytemuck::cast_slice(&vals)).unwrap();
                        for _ in 0..3 {
                            r.all_reduce_sum(b, &mut buf, DType::F32, 4);
                        }
                        b.download_f32(&buf, 5).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Three reductions: each multiplies the sum over ranks by 3 after the first.
        let expect: Vec<f32> = (0..4)
            .map(|i| 9.0 * (30.0 + 3.0 * i as f32))
            .chain([4.0])
            .collect();
        assert_eq!(sums[0][..4], expect[..4]);
        for (rank, s) in sums.iter().enumerate() {
            assert_eq!(s[..4], sums[0][..4], "rank {rank}");
            assert_eq!(s[4], rank as f32 * 10.0 + 4.0, "past numel stays");
        }

        // Rank 0 waits for a rank that fails instead of arriving.
        let ranks = HostGroup::ranks(2);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| {
                let mut buf = b.alloc(DType::F32, 1).unwrap();
                ranks[0].all_reduce_sum(&b, &mut buf, DType::F32, 1);
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            Collective::<CpuBackend>::abort(&ranks[1], "kernel failed");
            waiting.join().unwrap();
        });
        let why = Collective::<CpuBackend>::failure(&ranks[0]).unwrap();
        assert_eq!(why, "rank 1: kernel failed");
    }
}
