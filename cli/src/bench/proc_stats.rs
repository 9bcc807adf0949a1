//! Readings from `/proc` of the mesh's processes: CPU time, peak and current resident
//! memory; and the CPU time of one thread of the bench's own process (the `model`
//! workload's scripted server).

use std::collections::BTreeMap;

use super::Proc;

/// CPU seconds (user + system) of a process, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> f64 {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// CPU seconds (user + system) of one thread of this process, by its thread id
/// (`gettid`), from `/proc/self/task/<tid>/stat`.
pub fn thread_cpu_seconds(tid: i32) -> f64 {
    stat_cpu_seconds(&format!("/proc/self/task/{tid}/stat"))
}

/// utime + stime of a `stat` file of `/proc` (a process's or a thread's), in seconds; 0
/// when it cannot be read.
fn stat_cpu_seconds(path: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    #[allow(clippy::cast_precision_loss)] // CPU ticks fit f64 exactly for any real run
    let secs = ticks as f64 / rustix::param::clock_ticks_per_second() as f64;
    secs
}

/// Peak resident set size of a process in bytes, from `/proc/<pid>/status` (VmHWM).
pub fn peak_rss(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM:")
}

/// Resident set size of a process now, in bytes, from `/proc/<pid>/status` (VmRSS).
pub fn rss(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

fn status_bytes(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}

/// CPU seconds of each process, by name.
pub(super) fn cpu_by_process(processes: &[Proc]) -> BTreeMap<String, f64> {
    processes
        .iter()
        .map(|p| (p.name.clone(), cpu_seconds(p.pid)))
        .collect()
}

/// Peak RSS of each process, by name.
pub(super) fn peak_rss_by_process(processes: &[Proc]) -> BTreeMap<String, u64> {
    processes
        .iter()
        .map(|p| (p.name.clone(), peak_rss(p.pid)))
        .collect()
}
