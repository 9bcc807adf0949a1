//! Settings of the allocator every convene binary uses.
//!
//! The binaries allocate through mimalloc: its thread-local free lists cost a fraction of
//! the CPU of the system allocator under convene's allocation churn across many
//! threads. Left at its defaults on Linux, though, it commits its arenas eagerly and
//! keeps freed pages for later: a worker whose tool reads had run on a hundred blocking
//! threads at once stayed at 700 MiB resident long after they were done. With arenas
//! committed on demand and freed pages returned at once ([`SETTINGS`]), resident memory
//! follows what a process holds, at no measurable cost in throughput
//! (docs/benchmarks.md).
//!
//! mimalloc reads its settings from the environment when the process loads, before
//! `main`, so [`apply_allocator_settings`] re-executes the binary once with them added
//! when they are missing: same process id, arguments and environment otherwise. A value
//! already set (`MIMALLOC_PURGE_DELAY=10`, say) is kept.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;

/// The mimalloc settings every convene process runs with.
pub const SETTINGS: [(&str, &str); 2] = [
    // Commit arena memory as it is used, so that purging can give it back.
    ("MIMALLOC_ARENA_EAGER_COMMIT", "0"),
    // Give freed pages back to the OS at once rather than after a delay.
    ("MIMALLOC_PURGE_DELAY", "0"),
];

/// The settings of [`SETTINGS`] missing from an environment.
pub fn missing_settings(
    lookup: impl Fn(&str) -> Option<OsString>,
) -> Vec<(&'static str, &'static str)> {
    SETTINGS
        .iter()
        .filter(|(name, _)| lookup(name).is_none())
        .copied()
        .collect()
}

/// Makes sure this process runs with the allocator's [`SETTINGS`]: when one is missing
/// from the environment, re-executes the binary with it added. Call it first thing in
/// `main`, before any thread starts. Returns only when the settings are in place, or
/// when the binary cannot be re-executed (then it says so on stderr and the process
/// goes on with mimalloc's defaults).
pub fn apply_allocator_settings() {
    let missing = missing_settings(|name| std::env::var_os(name));
    if missing.is_empty() {
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!(
                "warning: cannot find this binary to apply the allocator settings ({e}); \
                 memory freed under load may stay resident"
            );
            return;
        }
    };
    let mut args = std::env::args_os();
    let mut command = std::process::Command::new(exe);
    if let Some(arg0) = args.next() {
        command.arg0(arg0);
    }
    command.args(args).envs(missing);
    // Only returns when the exec failed.
    let e = command.exec();
    eprintln!(
        "warning: cannot re-execute this binary with the allocator settings ({e}); memory \
         freed under load may stay resident"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_settings_not_already_set_are_added() {
        assert_eq!(missing_settings(|_| None), SETTINGS.to_vec());
        let purge_set =
            missing_settings(|name| (name == "MIMALLOC_PURGE_DELAY").then(|| OsString::from("10")));
        assert_eq!(purge_set, vec![("MIMALLOC_ARENA_EAGER_COMMIT", "0")]);
        assert!(missing_settings(|_| Some(OsString::from("1"))).is_empty());
    }
}
