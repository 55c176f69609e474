//! `punchclock-agent-shim -- <command> [args...]`: the agent shim as a
//! binary of its own (see the library's docs), installed beside
//! `punchclock`. The runner prefers it to `punchclock __agent-shim`: it
//! links nothing but libc and skips the Rust runtime's start-up (`no_main`:
//! no stack-guard probe of `/proc/self/maps`, no signal stack, no stdio
//! poll), so starting it costs a fraction of exec'ing the whole `punchclock`
//! binary for every execution.

#![no_main]

/// The C entry point; `std::env::args_os` still works (glibc passes
/// `argc`/`argv` to the initialisers std registers).
#[unsafe(no_mangle)]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    punchclock_agent_shim::shim_main(std::env::args_os().skip(1).collect())
}
