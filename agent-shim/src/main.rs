//! `punchclock-agent-shim -- <command> [args...]`: the agent shim as a
//! binary of its own (see the library's docs), installed beside
//! `punchclock`. The runner prefers it to `punchclock __agent-shim`: it
//! links nothing but libc and skips the Rust runtime's start-up (`no_main`:
//! no stack-guard probe of `/proc/self/maps`, no signal stack, no stdio
//! poll), so starting it costs a fraction of exec'ing the whole `punchclock`
//! binary for every execution.

#![no_main]

use std::ffi::{CStr, OsString};
use std::os::unix::ffi::OsStrExt;

/// The C entry point: the arguments come from `argv` itself (not
/// `std::env::args_os`, which without the Rust runtime relies on a glibc-only
/// initialiser). SIGPIPE is ignored, as the Rust runtime would (a closed
/// stderr must not kill the shim before it reports); the agent gets it back
/// at its default.
#[unsafe(no_mangle)]
extern "C" fn main(argc: libc::c_int, argv: *const *const libc::c_char) -> libc::c_int {
    // SAFETY: setting a signal disposition; the process has one thread.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let count = usize::try_from(argc).unwrap_or(0);
    let args: Vec<OsString> = (1..count)
        .map(|i| {
            // SAFETY: the C runtime passes `argc` valid, NUL-terminated
            // strings in `argv`, alive for the whole process.
            let arg = unsafe { CStr::from_ptr(*argv.add(i)) };
            std::ffi::OsStr::from_bytes(arg.to_bytes()).to_owned()
        })
        .collect();
    punchclock_agent_shim::shim_main(args)
}
