//! `dig`, run as a client would, and its answer read back: status, header flags, the answer and authority
//! sections, and which server the reply claims to come from.
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::exec::Cmd;

/// One resource record line of a section, e.g. `api.example.com. 30 IN A 203.0.113.10`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub name: String,
    pub ttl: u32,
    pub class: String,
    pub rtype: String,
    pub data: String,
}

/// What dig printed for one query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// `NOERROR`, `NXDOMAIN`, `SERVFAIL`, ...
    pub status: String,
    /// Header flags in dig's order, e.g. `["qr", "aa", "rd", "ra"]`.
    pub flags: Vec<String>,
    pub answer: Vec<Record>,
    pub authority: Vec<Record>,
    /// The `;; SERVER:` line: who the reply came from as the client saw it, e.g. `198.51.100.53#53(...)`.
    pub server: String,
    /// How long dig took, start to exit (process start included).
    pub elapsed: Duration,
    /// dig's own `;; Query time:`, from sending the query to the reply: what a deadline on the
    /// resolver is measured against (process start, slow under emulation, is not in it).
    pub query_time: Option<Duration>,
}

impl Reply {
    pub fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
    /// The A records of the answer section, in order.
    pub fn a_records(&self) -> Vec<Ipv4Addr> {
        self.answer
            .iter()
            .filter(|r| r.rtype == "A")
            .filter_map(|r| r.data.parse().ok())
            .collect()
    }
    /// Every address (A and AAAA) of the answer section, in order.
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.answer
            .iter()
            .filter(|r| r.rtype == "A" || r.rtype == "AAAA")
            .filter_map(|r| r.data.parse().ok())
            .collect()
    }
    /// Targets of the CNAME records of the answer section, without the trailing dot.
    pub fn cnames(&self) -> Vec<String> {
        self.answer
            .iter()
            .filter(|r| r.rtype == "CNAME")
            .map(|r| r.data.trim_end_matches('.').to_string())
            .collect()
    }
    /// What must be equal between two replies to the same question from the same resolver: everything
    /// but the message id, the timing and the server line.
    pub fn content(&self) -> (&str, &[String], &[Record], &[Record]) {
        (&self.status, &self.flags, &self.answer, &self.authority)
    }
}

/// Runs `cmd` (a `dig ...` command line, in any place) and parses its answer. A dig that got no answer
/// at all (timeout, exit status 9) is an error showing what it printed.
pub fn run(cmd: Cmd) -> Result<Reply> {
    let started = Instant::now();
    let out = cmd.output()?;
    let elapsed = started.elapsed();
    if !out.success() {
        bail!("dig got no answer: {out}");
    }
    let mut reply = parse(&out.stdout_str()).with_context(|| format!("reading {out}"))?;
    reply.elapsed = elapsed;
    Ok(reply)
}

/// Parses dig's default output (one query).
pub fn parse(text: &str) -> Result<Reply> {
    let mut reply = Reply {
        status: String::new(),
        flags: Vec::new(),
        answer: Vec::new(),
        authority: Vec::new(),
        server: String::new(),
        elapsed: Duration::ZERO,
        query_time: None,
    };
    #[derive(PartialEq)]
    enum Section {
        Other,
        Answer,
        Authority,
    }
    let mut section = Section::Other;
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix(";; ->>HEADER<<-") {
            reply.status = rest
                .split(',')
                .find_map(|part| part.trim().strip_prefix("status: "))
                .context("header without a status")?
                .to_string();
        } else if let Some(rest) = line.strip_prefix(";; flags:") {
            let flags = rest.split(';').next().unwrap_or_default();
            reply.flags = flags.split_whitespace().map(str::to_string).collect();
        } else if let Some(rest) = line.strip_prefix(";; Query time:") {
            let msec = rest.trim().trim_end_matches("msec").trim();
            reply.query_time = msec.parse().ok().map(Duration::from_millis);
        } else if let Some(rest) = line.strip_prefix(";; SERVER:") {
            reply.server = rest.trim().to_string();
        } else if line == ";; ANSWER SECTION:" {
            section = Section::Answer;
        } else if line == ";; AUTHORITY SECTION:" {
            section = Section::Authority;
        } else if line.is_empty() || line.starts_with(';') {
            section = Section::Other;
        } else if section != Section::Other {
            let record = parse_record(line).with_context(|| format!("record {line:?}"))?;
            match section {
                Section::Answer => reply.answer.push(record),
                Section::Authority => reply.authority.push(record),
                Section::Other => {}
            }
        }
    }
    if reply.status.is_empty() {
        bail!("no `->>HEADER<<-` line: not a dig answer");
    }
    Ok(reply)
}

fn parse_record(line: &str) -> Result<Record> {
    let mut parts = line.split_whitespace();
    let mut next = |what: &str| parts.next().with_context(|| format!("no {what}"));
    let name = next("name")?.to_string();
    let ttl = next("ttl")?.parse().context("ttl")?;
    let class = next("class")?.to_string();
    let rtype = next("type")?.to_string();
    let data: Vec<&str> = parts.collect();
    Ok(Record {
        name,
        ttl,
        class,
        rtype,
        data: data.join(" "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANSWERED: &str = "
; <<>> DiG 9.18.49-1~deb12u3-Debian <<>> api.example.com
;; global options: +cmd
;; Got answer:
;; ->>HEADER<<- opcode: QUERY, status: NOERROR, id: 54409
;; flags: qr aa rd ra; QUERY: 1, ANSWER: 2, AUTHORITY: 0, ADDITIONAL: 1

;; OPT PSEUDOSECTION:
; EDNS: version: 0, flags:; udp: 1232
;; QUESTION SECTION:
;api.example.com.team-a.svc.cluster.local. IN A

;; ANSWER SECTION:
api.example.com.team-a.svc.cluster.local. 30 IN CNAME api.example.com.
api.example.com.\t30\tIN\tA\t203.0.113.10

;; Query time: 0 msec
;; SERVER: 198.51.100.53#53(198.51.100.53) (UDP)
;; MSG SIZE  rcvd: 60
";

    const NXDOMAIN: &str = "
;; ->>HEADER<<- opcode: QUERY, status: NXDOMAIN, id: 39002
;; flags: qr rd ra; QUERY: 1, ANSWER: 0, AUTHORITY: 1, ADDITIONAL: 1

;; AUTHORITY SECTION:
example.com.\t0\tIN\tSOA\tns. host. 1 2 3 4 5

;; SERVER: 198.51.100.53#53(198.51.100.53) (UDP)
";

    #[test]
    fn reads_status_flags_sections_and_server() {
        let r = parse(ANSWERED).unwrap();
        assert_eq!(r.status, "NOERROR");
        assert_eq!(r.flags, ["qr", "aa", "rd", "ra"]);
        assert!(r.has_flag("aa"));
        assert_eq!(r.a_records(), [Ipv4Addr::new(203, 0, 113, 10)]);
        assert_eq!(r.cnames(), ["api.example.com"]);
        assert_eq!(r.answer[1].ttl, 30);
        assert!(r.authority.is_empty());
        assert_eq!(r.server, "198.51.100.53#53(198.51.100.53) (UDP)");
        assert_eq!(r.query_time, Some(Duration::ZERO));

        let r = parse(NXDOMAIN).unwrap();
        assert_eq!(r.query_time, None);
        assert_eq!(r.status, "NXDOMAIN");
        assert!(!r.has_flag("aa"));
        assert!(r.answer.is_empty());
        assert_eq!(r.authority[0].data, "ns. host. 1 2 3 4 5");
    }

    #[test]
    fn no_header_is_an_error() {
        assert!(parse(";; connection timed out; no servers could be reached\n").is_err());
        assert!(
            parse(";; ->>HEADER<<- opcode: QUERY, status: NOERROR\n;; ANSWER SECTION:\nbad\n")
                .is_err()
        );
    }
}
