//! The units of punchclock's file formats, shared by the control plane's
//! task model (`limits.memory_max` of a task) and the runner's agents file
//! (an agent's `limits.memory_max`): one notation, one parser. Kept apart
//! from the wire crate (`punchclock-proto`), which the decision core does
//! not name.

/// Parses a size: `512Mi`, `1Gi`, `64M`, `1000000` (bytes).
///
/// # Errors
///
/// A message saying what a size looks like.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = [
        ("Ki", 1u64 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("K", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ]
    .iter()
    .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n, *m)))
    .unwrap_or((s, 1));
    let n: u64 = num.trim().parse().map_err(|_| format!("{s:?}: a size such as 512Mi, 1Gi or 1000000 (bytes)"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("99999999999Ti").is_err());
    }
}
