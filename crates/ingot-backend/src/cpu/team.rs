//! The worker team the CPU backend splits its ops over: persistent threads that spin
//! between ops and park only after a pause.
//!
//! A decode step is a few hundred ops of tens of microseconds each, separated by short
//! serial stretches (activation quantization, small ops). rayon's idle workers go to sleep
//! after ~20 µs without work, so in a decode step most ops found the other thread asleep
//! and ran on one core while it woke (measured on the 2-core VM: a Q4_1 down projection,
//! 576 × 1536, took 22.8 µs with both threads awake and 46 µs after a 20 µs serial gap).
//! Here the caller publishes a job, works on it with the team, and waits (spinning) only for
//! the workers that joined it; idle workers spin for [`SPIN`] before parking, and
//! [`Team::rest`] parks them at once (before a long op that runs on rayon, which they would
//! slow down).

use super::SendPtr;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next job before parking.
const SPIN: Duration = Duration::from_millis(1);

/// A job: `n` tasks in one contiguous range per thread. Each thread takes the tasks of its
/// own range in order, then helps with the others' from where they are: a thread streams
/// through consecutive weight rows (which the hardware prefetchers follow), and a thread
/// that starts late or runs slow is caught up by the rest.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    /// The next task of each thread's range.
    cursors: &'a [Cursor],
}

/// One cache line per cursor, so threads taking tasks from their own ranges do not
/// contend.
#[repr(align(128))]
struct Cursor(AtomicUsize);

impl Job<'_> {
    fn range(&self, t: usize) -> (usize, usize) {
        let threads = self.cursors.len();
        (t * self.n / threads, (t + 1) * self.n / threads)
    }

    fn start(&self) {
        for (t, c) in self.cursors.iter().enumerate() {
            c.0.store(self.range(t).0, Relaxed);
        }
    }

    /// The work of thread `me`.
    fn work(&self, me: usize) {
        let threads = self.cursors.len();
        for r in (0..threads).map(|i| (me + i) % threads) {
            let end = self.range(r).1;
            loop {
                let i = self.cursors[r].0.fetch_add(1, Relaxed);
                if i >= end {
                    break;
                }
                (self.f)(i);
            }
        }
    }
}

/// `Shared::gate`: the job's epoch in the high half, then whether it is closed to new
/// workers, then how many workers joined it and have not finished.
const EPOCH_SHIFT: u32 = 32;
const CLOSED: u64 = 1 << 31;
const JOINED: u64 = CLOSED - 1;

struct Shared {
    /// A new job opens it with the next epoch; a worker joins the job by counting itself
    /// in while it is open; the caller, its own share done, closes it and waits only for
    /// the workers that joined. A worker that is descheduled (more threads than cores)
    /// therefore delays no job it has not joined: the caller takes its tasks.
    gate: AtomicU64,
    /// The current job. Written only by the caller of `run`, before it opens the gate and
    /// while no worker is joined; read by workers only after joining.
    job: UnsafeCell<*const Job<'static>>,
    /// Task cursors, one per thread, reused by every job.
    cursors: Box<[Cursor]>,
    /// Set by `rest`: spinning workers park at once.
    rest: AtomicBool,
    /// The first panic of a worker's task in the current job, re-raised by the caller.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    stop: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only while no worker reads it (see the field) and read only
// after joining through `gate` (release when opened, acquire when joined).
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw job pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Only one job runs at a time; a second caller waits (the backend is shared by
    /// reference, and tests call ops from several threads).
    running: Mutex<()>,
}

impl Team {
    /// A team of `threads` threads: the caller of [`Team::run`] and `threads - 1` workers.
    pub fn new(threads: usize) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            gate: AtomicU64::new(CLOSED),
            job: UnsafeCell::new(std::ptr::null()),
            cursors: (0..threads.max(1))
                .map(|_| Cursor(AtomicUsize::new(0)))
                .collect(),
            rest: AtomicBool::new(false),
            panic: Mutex::new(None),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("ingot-team-{i}"))
                    .spawn(move || worker(&shared, i))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Team {
            shared,
            workers,
            running: Mutex::new(()),
        })
    }

    /// Runs `f(0)`, …, `f(n - 1)` over the team and returns when all have finished.
    pub fn run(&self, n: usize, f: impl Fn(usize) + Sync) {
        if self.workers.is_empty() || n <= 1 {
            (0..n).for_each(f);
            return;
        }
        let _one = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job = Job {
            f: &f,
            n,
            cursors: &s.cursors,
        };
        job.start();
        // SAFETY: the gate is closed with no worker joined (the last `run` waited for them),
        // so none reads `job`; the pointer is cleared again below, before `job` goes out of
        // scope.
        unsafe { *s.job.get() = (&raw const job).cast::<Job<'static>>() };
        s.rest.store(false, Relaxed);
        let epoch = ((s.gate.load(Relaxed) >> EPOCH_SHIFT) + 1) & u64::from(u32::MAX);
        s.gate.store(epoch << EPOCH_SHIFT, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| job.work(0)));
        // Every task is taken now (or a task here panicked): close the job and wait for
        // the workers still running tasks.
        s.gate.fetch_or(CLOSED, AcqRel);
        while s.gate.load(Acquire) & JOINED != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: as above; no worker is joined and none can join.
        unsafe { *s.job.get() = std::ptr::null() };
        let theirs = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = theirs {
            resume_unwind(p);
        }
    }

    /// Runs `f(i, chunk)` for each `chunk`-long piece of `data` (the last may be shorter).
    pub fn chunks_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let (len, ptr) = (data.len(), SendPtr(data.as_mut_ptr()));
        self.run(len.div_ceil(chunk), |i| {
            let start = i * chunk;
            // SAFETY: tasks get disjoint ranges of `data`, which is borrowed mutably for
            // the whole call.
            let piece = unsafe {
                std::slice::from_raw_parts_mut(ptr.get().add(start), chunk.min(len - start))
            };
            f(i, piece)
        });
    }

    /// Parks idle workers now instead of after [`SPIN`]: the caller is about to run
    /// something long on other threads, which spinning workers would compete with.
    pub fn rest(&self) {
        self.shared.rest.store(true, Relaxed);
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(s: &Shared, me: usize) {
    let mut seen = 0u64;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        let mut gate = s.gate.load(Acquire);
        while gate >> EPOCH_SHIFT == seen {
            std::hint::spin_loop();
            spins += 1;
            // The clock is read every 256 spins: often enough for a 1 ms budget.
            if spins.is_multiple_of(256) && (s.rest.load(Relaxed) || started.elapsed() > SPIN) {
                park(s, seen);
            }
            if s.stop.load(Relaxed) {
                return;
            }
            gate = s.gate.load(Acquire);
        }
        seen = gate >> EPOCH_SHIFT;
        // Join while the job is open; a closed one is finished without this worker.
        while gate >> EPOCH_SHIFT == seen && gate & CLOSED == 0 {
            match s
                .gate
                .compare_exchange_weak(gate, gate + 1, AcqRel, Acquire)
            {
                Ok(_) => {
                    // SAFETY: the job was published before the gate opened and stays valid
                    // until this worker leaves it (the caller waits for that).
                    let job = unsafe { &**s.job.get() };
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| job.work(me))) {
                        s.panic
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(p);
                    }
                    s.gate.fetch_sub(1, Release);
                    break;
                }
                Err(now) => gate = now,
            }
        }
    }
}

/// Sleeps until the epoch moves past `seen` or the team stops.
fn park(s: &Shared, seen: u64) {
    let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
    s.sleepers.fetch_add(1, SeqCst);
    while s.gate.load(SeqCst) >> EPOCH_SHIFT == seen && !s.stop.load(SeqCst) {
        g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
    }
    s.sleepers.fetch_sub(1, SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_jobs_rests_and_callers() {
        let team = Team::new(3).unwrap();
        for n in [0usize, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            team.run(n, |i| {
                hits[i].fetch_add(1, Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "n {n}");
            if n % 2 == 0 {
                team.rest();
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let mut data = vec![0u32; 1001];
        team.chunks_mut(&mut data, 64, |i, c| {
            c.iter_mut().for_each(|x| *x += i as u32 + 1)
        });
        for (j, x) in data.iter().enumerate() {
            assert_eq!(*x, (j / 64) as u32 + 1);
        }
        // A panicking task reaches the caller, and the team keeps working.
        let caught = catch_unwind(AssertUnwindSafe(|| {
            team.run(64, |i| assert!(i != 40, "task 40 fails"));
        }));
        assert!(caught.is_err());
        let count = AtomicUsize::new(0);
        team.run(64, |_| {
            count.fetch_add(1, Relaxed);
        });
        assert_eq!(count.load(Relaxed), 64);
        // Two callers at once take turns.
        std::thread::scope(|sc| {
            for _ in 0..2 {
                sc.spawn(|| {
                    for _ in 0..200 {
                        let sum = AtomicUsize::new(0);
                        team.run(50, |i| {
                            sum.fetch_add(i, Relaxed);
                        });
                        assert_eq!(sum.load(Relaxed), 49 * 50 / 2);
                    }
                });
            }
        });
    }
}
