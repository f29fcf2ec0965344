//! `rdt-peer dns`: one question over a connected socket, as glibc and dig ask, to a server dig refuses
//! (dig skips v4-mapped addresses, the ones an `AF_INET6` runtime uses for an IPv4 resolver). Prints
//! the reply in dig's layout, so the harness reads both the same way.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use hickory_proto::op::{Message, MessageType, Query};
use hickory_proto::rr::{Name, Record, RecordType};

const TIMEOUT: Duration = Duration::from_secs(4);

pub(crate) fn ask(server: SocketAddr, name: &str, qtype: &str, tcp: bool) -> Result<()> {
    let qtype: RecordType = qtype.parse().context("record type")?;
    let name = Name::from_ascii(name).context("name")?;
    let id = (std::process::id() & 0xffff) as u16;
    let mut query = Message::query();
    query.metadata.id = id;
    query.metadata.recursion_desired = true;
    query.add_query(Query::query(name, qtype));
    let query = query.to_vec().context("encoding the query")?;

    let (raw, from) = if tcp {
        exchange_tcp(server, &query)?
    } else {
        exchange_udp(server, &query)?
    };
    let reply = Message::from_vec(&raw).context("decoding the reply")?;
    if reply.metadata.id != id || reply.metadata.message_type != MessageType::Response {
        bail!("not a reply to our query: {reply:?}");
    }
    print!("{}", dig_layout(&reply, from, tcp));
    Ok(())
}

/// connect() then send/recvfrom: the reply's source is what recvmsg() reports.
fn exchange_udp(server: SocketAddr, query: &[u8]) -> Result<(Vec<u8>, SocketAddr)> {
    let any = if server.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    };
    let socket = UdpSocket::bind(any).context("binding")?;
    socket.connect(server).context("connect")?;
    socket.set_read_timeout(Some(TIMEOUT))?;
    socket.send(query).context("send")?;
    let mut buf = vec![0u8; 65_535];
    let (n, from) = socket.recv_from(&mut buf).context("recvfrom")?;
    buf.truncate(n);
    Ok((buf, from))
}

/// Length-prefixed over TCP; the server is what getpeername() reports.
fn exchange_tcp(server: SocketAddr, query: &[u8]) -> Result<(Vec<u8>, SocketAddr)> {
    let mut stream = TcpStream::connect_timeout(&server, TIMEOUT).context("connect")?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    let len = u16::try_from(query.len()).context("query too long")?;
    stream.write_all(&len.to_be_bytes())?;
    stream.write_all(query)?;
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).context("reading the length")?;
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut buf).context("reading the reply")?;
    Ok((buf, stream.peer_addr().context("getpeername")?))
}

fn dig_layout(reply: &Message, from: SocketAddr, tcp: bool) -> String {
    let m = &reply.metadata;
    let status = match u16::from(m.response_code) {
        0 => "NOERROR".to_string(),
        1 => "FORMERR".to_string(),
        2 => "SERVFAIL".to_string(),
        3 => "NXDOMAIN".to_string(),
        4 => "NOTIMP".to_string(),
        5 => "REFUSED".to_string(),
        n => format!("RCODE{n}"),
    };
    let flags: Vec<&str> = [
        (m.message_type == MessageType::Response, "qr"),
        (m.authoritative, "aa"),
        (m.truncation, "tc"),
        (m.recursion_desired, "rd"),
        (m.recursion_available, "ra"),
        (m.authentic_data, "ad"),
        (m.checking_disabled, "cd"),
    ]
    .into_iter()
    .filter_map(|(set, flag)| set.then_some(flag))
    .collect();
    let mut out = format!(
        ";; ->>HEADER<<- opcode: QUERY, status: {status}, id: {}\n;; flags: {};\n",
        m.id,
        flags.join(" ")
    );
    let section = |out: &mut String, title: &str, records: &[Record]| {
        if records.is_empty() {
            return;
        }
        out.push_str(&format!("\n;; {title} SECTION:\n"));
        for r in records {
            out.push_str(&format!(
                "{}\t{}\tIN\t{}\t{}\n",
                r.name,
                r.ttl,
                r.record_type(),
                r.data
            ));
        }
    };
    section(&mut out, "ANSWER", &reply.answers);
    section(&mut out, "AUTHORITY", &reply.authorities);
    let proto = if tcp { "TCP" } else { "UDP" };
    out.push_str(&format!(
        "\n;; SERVER: {}#{}({}) ({proto})\n",
        from.ip(),
        from.port(),
        from.ip()
    ));
    out
}

/// `rdt-peer dns-burst`: `count` A questions in flight at once from one connected UDP socket, under
/// ids `0..count`, cycling through `expect` (NAME=IP) from `offset` (so two pods with the same ids
/// ask different names under each id). Every reply must carry an id that was sent, the question
/// sent under it, NOERROR and the expected address. Prints `sent= answered= wrong= missing=`, then
/// one `wrong ...` line per bad reply (the first 20); exits 0 only when all were answered rightly.
pub(crate) fn burst(
    server: SocketAddr,
    expect: &[String],
    count: u16,
    offset: usize,
) -> Result<()> {
    let expect: Vec<(Name, std::net::Ipv4Addr)> = expect
        .iter()
        .map(|pair| {
            let (name, ip) = pair.split_once('=').context("NAME=IP")?;
            Ok((Name::from_ascii(name)?, ip.parse()?))
        })
        .collect::<Result<_>>()?;
    if expect.is_empty() {
        bail!("no --expect NAME=IP");
    }
    let socket = UdpSocket::bind(if server.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    })?;
    socket.connect(server).context("connect")?;
    let asked: Vec<usize> = (0..usize::from(count))
        .map(|id| (id + offset) % expect.len())
        .collect();
    for (id, which) in asked.iter().enumerate() {
        let mut query = Message::query();
        query.metadata.id = id as u16;
        query.metadata.recursion_desired = true;
        query.add_query(Query::query(expect[*which].0.clone(), RecordType::A));
        socket.send(&query.to_vec()?).context("send")?;
    }
    let mut answered = vec![false; asked.len()];
    let mut wrong = Vec::new();
    let deadline = std::time::Instant::now() + TIMEOUT;
    let mut buf = vec![0u8; 65_535];
    while answered.iter().any(|a| !a) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        socket.set_read_timeout(Some(left))?;
        let Ok(n) = socket.recv(&mut buf) else { break };
        let reply = match Message::from_vec(&buf[..n]) {
            Ok(reply) => reply,
            Err(e) => {
                wrong.push(format!("undecodable reply: {e}"));
                continue;
            }
        };
        let id = usize::from(reply.metadata.id);
        let Some(&which) = asked.get(id) else {
            wrong.push(format!("id {id} was never sent"));
            continue;
        };
        let (name, ip) = &expect[which];
        let question = reply.queries.first().map(|q| q.name().clone());
        let address = reply.answers.iter().find_map(|r| match &r.data {
            hickory_proto::rr::RData::A(a) => Some(a.0),
            _ => None,
        });
        if question.as_ref() != Some(name) || address != Some(*ip) || answered[id] {
            wrong.push(format!(
                "id {id}: asked {name}, got question {question:?} address {address:?} (answered before: {})",
                answered[id]
            ));
        }
        answered[id] = true;
    }
    let done = answered.iter().filter(|a| **a).count();
    println!(
        "sent={} answered={done} wrong={} missing={}",
        asked.len(),
        wrong.len(),
        asked.len() - done
    );
    for line in wrong.iter().take(20) {
        println!("wrong {line}");
    }
    if !wrong.is_empty() || done < asked.len() {
        bail!("not every query was answered rightly");
    }
    Ok(())
}
