//! How many worker threads the CPU backend starts by default: one per physical core the
//! process may use. Decode is bound by memory bandwidth, and a second hyperthread on a
//! core adds contention for it rather than throughput (llama.cpp defaults the same way).

use std::collections::HashSet;

/// Physical cores, capped by the CPUs this process may run on (affinity, cgroup quota).
pub fn default_threads() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores().map_or(logical, |p| p.min(logical)).max(1)
}

/// Distinct (package, core) pairs in sysfs; `None` where sysfs has no CPU topology.
fn physical_cores() -> Option<usize> {
    let mut cores = HashSet::new();
    for entry in std::fs::read_dir("/sys/devices/system/cpu").ok()?.flatten() {
        let name = entry.file_name();
        let Some(index) = name.to_str().and_then(|n| n.strip_prefix("cpu")) else {
            continue;
        };
        if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let topology = entry.path().join("topology");
        let read = |f: &str| -> Option<i64> {
            std::fs::read_to_string(topology.join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        if let (Some(package), Some(core)) = (read("physical_package_id"), read("core_id")) {
            cores.insert((package, core));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_threads_are_physical_cores_within_the_allowed_cpus() {
        let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = default_threads();
        assert!((1..=logical).contains(&threads), "{threads} of {logical}");
        if let Some(physical) = physical_cores() {
            assert_eq!(threads, physical.min(logical));
        }
    }
}
