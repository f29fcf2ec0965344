//! Time budgets that stretch under emulation. In a VM without hardware virtualisation every
//! instruction is emulated and the suite runs about 20 times slower; the VM runner then sets
//! `RDT_TIME_SCALE` and the harness's timeouts and the tests' deadlines are multiplied by it. On real
//! hardware it is unset and every budget is what the test says.
use std::time::Duration;

/// The multiplier: `RDT_TIME_SCALE` (1 to 100), else 1.
pub fn scale() -> u32 {
    std::env::var("RDT_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(1, |s: u32| s.clamp(1, 100))
}

/// `budget`, stretched by [`scale`].
pub fn scaled(budget: Duration) -> Duration {
    budget * scale()
}

/// A whole number of seconds for a command line flag (`curl --max-time`), stretched by [`scale`].
pub fn scaled_secs(secs: u64) -> String {
    scaled(Duration::from_secs(secs)).as_secs().to_string()
}
