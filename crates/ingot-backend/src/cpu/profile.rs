//! Wall time per op for `--profile-ops`. CPU ops run to completion inside their call, so
//! an op's time is the wall time of the call: the fork and join of its worker threads
//! included, which is what a decode step of small ops pays.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

#[derive(Default)]
pub struct OpProfiler {
    on: AtomicBool,
    totals: Mutex<HashMap<String, (u64, f64)>>,
}

/// Adds its op's elapsed time to the profile when dropped.
pub struct OpTimer<'a> {
    profiler: &'a OpProfiler,
    op: String,
    start: Instant,
}

impl OpProfiler {
    /// Clears the totals and times every op from now on.
    pub fn start(&self) {
        self.lock().clear();
        self.on.store(true, Ordering::Relaxed);
    }

    /// A timer for one call of the op `label` names, or `None` (and no label built) while
    /// the profile is off.
    pub fn time(&self, label: impl FnOnce() -> String) -> Option<OpTimer<'_>> {
        self.on.load(Ordering::Relaxed).then(|| OpTimer {
            profiler: self,
            op: label(),
            start: Instant::now(),
        })
    }

    /// (op, calls, milliseconds), longest first.
    pub fn totals(&self) -> Vec<(String, u64, f64)> {
        let mut ops: Vec<_> = self
            .lock()
            .iter()
            .map(|(k, &(n, ms))| (k.clone(), n, ms))
            .collect();
        ops.sort_by(|a, b| b.2.total_cmp(&a.2));
        ops
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, f64)>> {
        self.totals.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        let ms = self.start.elapsed().as_secs_f64() * 1e3;
        let mut totals = self.profiler.lock();
        let e = totals
            .entry(std::mem::take(&mut self.op))
            .or_insert((0, 0.0));
        e.0 += 1;
        e.1 += ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_only_while_started_and_sums_calls_per_op() {
        let p = OpProfiler::default();
        assert!(p.time(|| unreachable!("no label while off")).is_none());
        p.start();
        for _ in 0..3 {
            let _t = p.time(|| "matmul m1".to_string());
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        drop(p.time(|| "rope".to_string()));
        let totals = p.totals();
        assert_eq!(totals[0].0, "matmul m1");
        assert_eq!(totals[0].1, 3);
        assert!(totals[0].2 >= 6.0, "{totals:?}");
        assert_eq!((totals[1].0.as_str(), totals[1].1), ("rope", 1));
        p.start();
        assert!(p.totals().is_empty());
    }
}
