//! `metadata.creationTimestamp`: RFC 3339, as the API server writes it (`2024-05-01T12:00:00Z`).
//! Only ordering matters (the ranking rule), so this keeps seconds and nanoseconds since the epoch.
use std::fmt;

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp {
    secs: i64,
    nanos: u32,
}

impl Timestamp {
    pub fn from_unix(secs: i64) -> Self {
        Timestamp { secs, nanos: 0 }
    }

    pub fn unix_seconds(&self) -> i64 {
        self.secs
    }

    /// Parses `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`; `None` when the text is not that.
    pub fn parse(text: &str) -> Option<Self> {
        let b = text.as_bytes();
        if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
            return None;
        }
        if b[13] != b':' || b[16] != b':' {
            return None;
        }
        let num = |range: std::ops::Range<usize>| -> Option<i64> {
            let s = text.get(range)?;
            if !s.bytes().all(|c| c.is_ascii_digit()) {
                return None;
            }
            s.parse().ok()
        };
        let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
            return None;
        }
        if hour > 23 || minute > 59 || second > 60 {
            return None;
        }
        let mut rest = &text[19..];
        let mut nanos = 0u32;
        if let Some(frac) = rest.strip_prefix('.') {
            let digits = frac.bytes().take_while(|c| c.is_ascii_digit()).count();
            if digits == 0 {
                return None;
            }
            for (i, c) in frac.bytes().take(digits).enumerate() {
                if i < 9 {
                    nanos += u32::from(c - b'0') * 10u32.pow(8 - i as u32);
                }
            }
            rest = &frac[digits..];
        }
        let offset = match rest {
            "Z" | "z" => 0,
            _ => {
                let ob = rest.as_bytes();
                if ob.len() != 6 || !matches!(ob[0], b'+' | b'-') || ob[3] != b':' {
                    return None;
                }
                let h: i32 = rest.get(1..3)?.parse().ok()?;
                let m: i32 = rest.get(4..6)?.parse().ok()?;
                let sign = if ob[0] == b'-' { -1 } else { 1 };
                sign * (h * 3600 + m * 60)
            }
        };
        let days = days_from_civil(year, month, day);
        let secs = days * 86_400 + hour * 3600 + minute * 60 + second - i64::from(offset);
        Some(Timestamp { secs, nanos })
    }
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Prints in UTC, the way the API server does.
impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let days = self.secs.div_euclid(86_400);
        let rem = self.secs.rem_euclid(86_400);
        let (y, m, d) = civil_from_days(days);
        write!(
            f,
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )?;
        if self.nanos != 0 {
            write!(f, ".{:09}", self.nanos)?;
        }
        f.write_str("Z")
    }
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_orders_rfc3339() {
        struct Case {
            name: &'static str,
            text: &'static str,
            unix: Option<i64>,
        }
        let cases = [
            Case {
                name: "epoch",
                text: "1970-01-01T00:00:00Z",
                unix: Some(0),
            },
            Case {
                name: "api server form",
                text: "2024-05-01T12:00:00Z",
                unix: Some(1_714_564_800),
            },
            Case {
                name: "fraction",
                text: "2024-05-01T12:00:00.5Z",
                unix: Some(1_714_564_800),
            },
            Case {
                name: "offset",
                text: "2024-05-01T14:00:00+02:00",
                unix: Some(1_714_564_800),
            },
            Case {
                name: "leap day",
                text: "2024-02-29T00:00:00Z",
                unix: Some(1_709_164_800),
            },
            Case {
                name: "no leap day",
                text: "2023-02-29T00:00:00Z",
                unix: None,
            },
            Case {
                name: "date only",
                text: "2024-05-01",
                unix: None,
            },
            Case {
                name: "garbage",
                text: "yesterday at noon ok",
                unix: None,
            },
            Case {
                name: "bad hour",
                text: "2024-05-01T25:00:00Z",
                unix: None,
            },
        ];
        for case in cases {
            let got = Timestamp::parse(case.text).map(|t| t.unix_seconds());
            assert_eq!(got, case.unix, "{}", case.name);
        }
        let a = Timestamp::parse("2024-05-01T12:00:00Z").unwrap();
        let b = Timestamp::parse("2024-05-01T12:00:00.1Z").unwrap();
        assert!(a < b);
        assert_eq!(a.to_string(), "2024-05-01T12:00:00Z");
    }
}
