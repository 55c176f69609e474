//! The process's open-files limit, shared by `server`, `runner` and `dev`.

/// Raises the soft limit on open descriptors to the hard limit (as Go's
/// runtime and most servers do) and returns the soft limit now in force
/// (`None`: unlimited, or it cannot be read). A runner's agents hold three
/// or four of its descriptors each, and the control plane's ports one per
/// connection: the default soft limit (often 1,024) would cap either far
/// below what the hard limit allows. The control plane's connection caps
/// default to shares of the result (`punchclock_control_plane::conns`).
/// Best effort: a limit that cannot be raised is kept (and said).
pub fn raise_open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write an rlimit we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                tracing::debug!(from = limit.rlim_cur, to = raised.rlim_cur, "raised the open files limit");
                limit = raised;
            } else {
                let e = std::io::Error::last_os_error();
                tracing::warn!(soft = limit.rlim_cur, hard = limit.rlim_max, error = %e, "cannot raise the open files limit");
            }
        }
    }
    (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}
