//! `punchclock`: the one binary — `server`, `runner`, `dev`, and the client
//! commands over the gRPC API. See `cli/README.md` for the module map.

mod client;
mod commands;
mod limits;
mod output;
mod security;
mod taskfile;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // The agent shim must not start a tokio runtime or parse clap args: it
    // is exec'd between the runner and every agent process.
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|a| a == punchclock_agent_runner::SHIM_SUBCOMMAND) {
        punchclock_agent_runner::shim_main(std::env::args_os().skip(2).collect());
    }
    let cli = commands::Cli::parse();
    if !cli.is_long_running() {
        // A client printing into a closed pipe (`punchclock runs list | head`)
        // ends quietly, as any Unix filter does, instead of panicking. Never
        // for dev/server/runner: an agent that exits without reading its
        // stdin would then kill the whole runner with SIGPIPE.
        // SAFETY: resetting a signal disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // Flushes the log lines still buffered when main returns.
    let log_guard = commands::init_tracing(&cli);
    // `server`, `runner` and `dev` raise the soft open-files limit to the
    // hard one, before the runtime's threads start.
    let open_files = if cli.is_long_running() { limits::raise_open_files_limit() } else { None };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = rt.block_on(commands::run(cli, open_files));
    // The buffered log lines go out before the error line below.
    drop(log_guard);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // An empty error is an answer already printed that exits 1 (`config
        // diff` with a difference).
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}");
            }
            ExitCode::from(1)
        }
    }
}
