//! The allocator every convene binary uses (mimalloc, with the settings of
//! `convene_server::alloc`) gives back the memory a burst of allocations on many
//! threads freed, so a process's resident memory follows what it holds rather than the
//! most it ever held. A test binary of its own, holding this one test: the global
//! allocator is per binary, and applying the settings re-executes the binary as each
//! convene binary does.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MIB: u64 = 1024 * 1024;

/// This process's resident set size, from `/proc/self/status`.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kb * 1024
}

#[test]
fn memory_a_burst_on_many_threads_freed_is_given_back() {
    convene_server::alloc::apply_allocator_settings();
    for (name, value) in convene_server::alloc::SETTINGS {
        assert_eq!(std::env::var(name).as_deref(), Ok(value), "{name}");
    }
    const THREADS: usize = 64;
    const CHUNKS: usize = 32;
    const CHUNK: usize = 256 * 1024;
    let before = rss();
    // Every thread holds 8 MiB of written memory at once (512 MiB in all), as a worker's
    // tool reads do on their blocking threads under load; then all of it is freed and
    // the threads end.
    let all_held = Arc::new(Barrier::new(THREADS + 1));
    let release = Arc::new(Barrier::new(THREADS + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (all_held, release) = (all_held.clone(), release.clone());
            std::thread::spawn(move || {
                let chunks: Vec<Vec<u8>> = (0..CHUNKS)
                    .map(|i| vec![(t + i) as u8 | 1; CHUNK])
                    .collect();
                all_held.wait();
                release.wait();
                chunks.iter().map(|c| u64::from(c[CHUNK - 1])).sum::<u64>()
            })
        })
        .collect();
    all_held.wait();
    let peak = rss();
    release.wait();
    for t in threads {
        assert!(t.join().expect("a thread") > 0);
    }
    assert!(
        peak >= before + 400 * MIB,
        "the burst did not reach memory: {} MiB before, {} MiB at its peak",
        before / MIB,
        peak / MIB
    );

    // Freed pages go back at once; wait generously all the same.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = rss();
        if now <= before + 64 * MIB {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the freed memory was kept: {} MiB before the burst, {} MiB at its peak, {} MiB \
             a minute after it was freed",
            before / MIB,
            peak / MIB,
            now / MIB
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
