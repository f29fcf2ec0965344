//! rdt-peer: the far end (and the odd client) of the integration tests.
//!
//! `serve` answers HTTP on every `--listen` address (`GET /` -> name, `GET /peer` -> the client address it
//! saw, `GET /blob/<n>` -> n pattern bytes, `POST /sha256` -> hex sha256 of the body) and echoes raw TCP on
//! every `--echo` address. `hbone` terminates HBONE (HTTP/2 CONNECT over mutual TLS) as a waypoint
//! would; `hbone-client` opens one such tunnel. The client subcommands do what curl cannot: see
//! `--help`.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod ca;
mod client;
mod dns;
mod hbone;
mod hostile;
mod load;
mod mix;
mod serve;

#[derive(Debug, Parser)]
#[command(
    name = "rdt-peer",
    about = "Identity HTTP/echo server and test clients for the integration suite"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve identity HTTP and raw TCP echo until killed.
    Serve {
        /// The name `GET /` answers with.
        #[arg(long)]
        name: String,
        /// HTTP listen address (repeatable).
        #[arg(long = "listen")]
        http: Vec<SocketAddr>,
        /// TCP echo listen address (repeatable).
        #[arg(long = "echo")]
        echo: Vec<SocketAddr>,
        /// Sends pattern bytes to each client until the connection fails (repeatable).
        #[arg(long)]
        source: Vec<SocketAddr>,
        /// Reads each client to its end and prints `sink eof N` or `sink error N KIND` (repeatable).
        #[arg(long)]
        sink: Vec<SocketAddr>,
    },
    /// Connect and print what getpeername() returns.
    Getpeername {
        addr: SocketAddr,
        /// An MPTCP socket (`IPPROTO_MPTCP`), as recent curl and Go may open, instead of TCP.
        #[arg(long)]
        mptcp: bool,
    },
    /// Connect, print `peer ADDR` (what getpeername() returns), then again for every line on stdin,
    /// on the same connection, until stdin closes.
    PeerWatch { addr: SocketAddr },
    /// Open `--count` UDP sockets connected to `server`, each read back with getpeername(), and
    /// hold them: print `open N original=M` (M showed `server`), then wait for a line (or EOF) on
    /// stdin (the open-files limit bounds `--count`).
    UdpConnected {
        server: SocketAddr,
        #[arg(long)]
        count: usize,
    },
    /// `--conns` short connections to an echo server, one after the other: each sends a line, reads
    /// the echo and closes first (as a client that ends its request does). Prints
    /// the first error of each kind, then `ok=N reset=N failed=N ms=N`.
    Churn {
        addr: SocketAddr,
        #[arg(long)]
        conns: usize,
    },
    /// Start `--count` connections to `addr` and close each at once, before its handshake can
    /// complete (a non-blocking connect() closed in SYN_SENT); print `abandoned N`.
    Abandon {
        addr: SocketAddr,
        #[arg(long)]
        count: usize,
    },
    /// Send N pattern bytes to an echo server while reading the echo; print both checksums.
    Echo {
        addr: SocketAddr,
        #[arg(long)]
        bytes: u64,
        /// Send at most this many MiB per second (0: as fast as possible).
        #[arg(long, default_value_t = 0)]
        rate_mib: u64,
    },
    /// Open N connections to an echo server at once, print `open N`, then (after a line on stdin with
    /// --wait-stdin) push `--bytes` through each and check the echo; print `done ok=.. failed=..`.
    Fanout {
        addr: SocketAddr,
        #[arg(long)]
        conns: usize,
        #[arg(long, default_value_t = 4096)]
        bytes: usize,
        #[arg(long)]
        wait_stdin: bool,
    },
    /// Ask `server` for the A records of `name` from an unconnected UDP socket (sendto/recvfrom);
    /// print the reply's source address, rcode, aa flag and answers.
    DnsUnconnected { server: SocketAddr, name: String },
    /// Ask `server` one question from a connected UDP socket (or over TCP) and print the reply in
    /// dig's layout; works where dig will not (v4-mapped server addresses).
    Dns {
        server: SocketAddr,
        name: String,
        #[arg(default_value = "A")]
        qtype: String,
        #[arg(long)]
        tcp: bool,
    },
    /// `COUNT` A questions in flight at once from one connected UDP socket (ids 0..COUNT, names
    /// from `--expect NAME=IP` in turn from `--offset`); every reply must answer the question sent
    /// under its id with IP. Prints `sent= answered= wrong= missing=`.
    DnsBurst {
        server: SocketAddr,
        #[arg(long)]
        count: u16,
        #[arg(long = "expect")]
        expect: Vec<String>,
        #[arg(long, default_value_t = 0)]
        offset: usize,
    },
    /// Keep one connection to an echo server and exchange a line every interval, printing `ok <i>`.
    Hold {
        addr: SocketAddr,
        #[arg(long, default_value_t = 200)]
        interval_ms: u64,
        /// Stop after this many exchanges (default: until killed).
        #[arg(long)]
        count: Option<u64>,
    },
    /// Send junk and valid DNS queries in turn from one connected UDP socket, at full speed.
    DnsFlood {
        server: SocketAddr,
        #[arg(long)]
        seconds: u64,
    },
    /// Open N idle connections, print `open= reset= closed=` after a second, hold until stdin.
    HoldIdle {
        addr: SocketAddr,
        #[arg(long)]
        conns: usize,
    },
    /// Open N connections to an echo server, each exchanging a line within 10 s; print how many
    /// worked, were reset, closed cleanly or hung; hold the working ones until a line on stdin.
    Storm {
        addr: SocketAddr,
        #[arg(long)]
        conns: usize,
    },
    /// Read until the stream ends: `eof N` (exit 0) or `error N KIND` (exit 1).
    Read { addr: SocketAddr },
    /// New connections and DNS queries in turn, paced at `--rate` per second over `--workers`
    /// threads, until a line (or EOF) on stdin; then `done ok=N failed=M secs=S` and one
    /// `fail WHAT: ERROR` line per failure (the first 50). Exit 0 only without failures.
    Mix {
        /// `IP:PORT=BODY`: GET / there must answer 200 with BODY (repeatable).
        #[arg(long)]
        http: Vec<String>,
        /// `SERVER=NAME`: an A question over connected UDP, answered NOERROR with an address
        /// (repeatable).
        #[arg(long)]
        dns: Vec<String>,
        #[arg(long, default_value_t = 600)]
        rate: u32,
        #[arg(long, default_value_t = 8)]
        workers: usize,
    },
    /// Write until the stream fails: `error N KIND` (exit 1).
    Write { addr: SocketAddr },
    /// `GET /` over HTTP/1.0 from local port `--from-port`, the body on stdout; the connection is
    /// closed with a reset, so the address and port are free again at once (no TIME_WAIT).
    Fetch {
        addr: SocketAddr,
        #[arg(long)]
        from_port: u16,
    },
    /// Sends `--count` DNS queries (A `name`) to `server` over UDP, each from a forged source
    /// address counting up from `--from`, through a raw socket (needs CAP_NET_RAW).
    DnsForge {
        server: std::net::SocketAddrV4,
        name: String,
        #[arg(long)]
        from: std::net::Ipv4Addr,
        #[arg(long)]
        count: u32,
    },
    /// Terminate HBONE until killed: mutual TLS 1.3 (ALPN h2, a client certificate chaining to
    /// `--root` required), then HTTP/2 CONNECT, each tunnel carried to its `--route` backend over
    /// TCP. Prints `listening ADDR`, then per event `connect authority= identity= backend= status=`,
    /// `closed authority= sent= received=`, `refused tls error=`, `refused method=`; and per TCP
    /// connection `accepted n= from=` (n counts from 1) and `ended n=`.
    Hbone {
        /// Name for the logs.
        #[arg(long)]
        name: String,
        /// Listen address (repeatable).
        #[arg(long)]
        listen: Vec<SocketAddr>,
        /// Own certificate chain (PEM, leaf first).
        #[arg(long)]
        cert: PathBuf,
        /// Own private key (PEM).
        #[arg(long)]
        key: PathBuf,
        /// Roots client certificates must chain to (PEM).
        #[arg(long)]
        root: PathBuf,
        /// `AUTHORITY=BACKEND`: a CONNECT to AUTHORITY (IP:PORT) is carried to BACKEND (IP:PORT)
        /// (repeatable); any other authority gets 503.
        #[arg(long = "route")]
        routes: Vec<String>,
        /// Take each TCP connection and never answer TLS; print `stalled n= secs=` when the
        /// client leaves.
        #[arg(long, conflicts_with_all = ["goaway_first", "refuse_first_stream"])]
        stall_tls: bool,
        /// Answer the first CONNECT of the first connection with GOAWAY(last_stream_id=0,
        /// NO_ERROR) (`goaway stream=`); serve everything after.
        #[arg(long, conflicts_with = "refuse_first_stream")]
        goaway_first: bool,
        /// Reset the first CONNECT of the first connection with REFUSED_STREAM
        /// (`refused stream=`); serve everything after.
        #[arg(long)]
        refuse_first_stream: bool,
    },
    /// Serve Istio's CA service (`CreateCertificate`) on TLS until killed, signing with the
    /// suite's CA saved in `--ca-dir`. Prints `listening ADDR`, then per call
    /// `issued identity= ttl=Ns cluster= asked=Ns` or `refused code= why=`.
    Ca {
        #[arg(long)]
        listen: SocketAddr,
        /// `root-cert.pem` and `root-key.pem` (`TestCa::save`).
        #[arg(long)]
        ca_dir: PathBuf,
        #[arg(long)]
        trust_domain: String,
        /// A name of the serving certificate (repeatable): a host name or an IP.
        #[arg(long = "name")]
        names: Vec<String>,
        /// The file holding the one bearer token accepted.
        #[arg(long)]
        token: PathBuf,
        /// `NAMESPACE/ACCOUNT` a caller may ask a certificate for (repeatable).
        #[arg(long)]
        allow: Vec<String>,
        /// The longest lifetime granted, in seconds: a longer one asked for is shortened to it
        /// (as a CA with a maximum certificate lifetime does).
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// One HBONE tunnel: mutual TLS 1.3 to `--connect` (the server's certificate must chain to
    /// `--root`; its names are not checked), HTTP/2 CONNECT `--authority`. Prints
    /// `peer identity=URI`, `status N`; on 200 sends `--send`, half-closes and prints
    /// `got TEXT` with everything read back. Exits 1 unless the status is 200 and the tunnel ends cleanly.
    HboneClient {
        #[arg(long)]
        connect: SocketAddr,
        /// Own certificate chain (PEM, leaf first).
        #[arg(long)]
        cert: PathBuf,
        /// Own private key (PEM).
        #[arg(long)]
        key: PathBuf,
        /// Roots the server's certificate must chain to (PEM).
        #[arg(long)]
        root: PathBuf,
        /// The CONNECT target, `IP:PORT`.
        #[arg(long)]
        authority: String,
        /// Text to send through the tunnel before half-closing it.
        #[arg(long)]
        send: Option<String>,
    },
    /// A peer holding a valid certificate that attacks the receiving side of HBONE: `flood`,
    /// `reset` or `idle` (see `hostile.rs`). Prints `ready ...` or `done ...` lines.
    Hostile {
        #[arg(long, value_enum)]
        mode: hostile::Mode,
        #[arg(long)]
        connect: SocketAddr,
        /// Own certificate chain (PEM, leaf first).
        #[arg(long)]
        cert: PathBuf,
        /// Own private key (PEM).
        #[arg(long)]
        key: PathBuf,
        /// The CONNECT target, `IP:PORT`.
        #[arg(long)]
        authority: String,
        #[arg(long, default_value_t = 1)]
        conns: usize,
        #[arg(long, default_value_t = 200)]
        streams: usize,
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        #[arg(long, default_value_t = 50)]
        reset_ms: u64,
        #[arg(long, default_value_t = 3000)]
        push_ms: u64,
        /// A source address, taken in turn by the connections (repeatable).
        #[arg(long)]
        from: Vec<std::net::IpAddr>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    raise_fd_limit();
    // Both of rustls' providers are built into the workspace, so tonic's server, which takes the
    // process's default, needs one named.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let result = match cli.command {
        Command::Serve {
            name,
            http,
            echo,
            source,
            sink,
        } => serve::serve(&name, &http, &echo, &source, &sink),
        Command::Getpeername { addr, mptcp } => client::getpeername(addr, mptcp),
        Command::PeerWatch { addr } => client::peer_watch(addr),
        Command::UdpConnected { server, count } => load::udp_connected(server, count),
        Command::Churn { addr, conns } => load::churn(addr, conns),
        Command::Abandon { addr, count } => load::abandon(addr, count),
        Command::Echo {
            addr,
            bytes,
            rate_mib,
        } => client::echo(addr, bytes, rate_mib),
        Command::Fanout {
            addr,
            conns,
            bytes,
            wait_stdin,
        } => client::fanout(addr, conns, bytes, wait_stdin),
        Command::DnsUnconnected { server, name } => client::dns_unconnected(server, &name),
        Command::Dns {
            server,
            name,
            qtype,
            tcp,
        } => dns::ask(server, &name, &qtype, tcp),
        Command::DnsBurst {
            server,
            count,
            expect,
            offset,
        } => dns::burst(server, &expect, count, offset),
        Command::Hold {
            addr,
            interval_ms,
            count,
        } => client::hold(addr, interval_ms, count),
        Command::DnsFlood { server, seconds } => load::dns_flood(server, seconds),
        Command::HoldIdle { addr, conns } => load::hold_idle(addr, conns),
        Command::Storm { addr, conns } => load::storm(addr, conns),
        Command::Read { addr } => load::read(addr),
        Command::Mix {
            http,
            dns,
            rate,
            workers,
        } => mix::run(&http, &dns, rate, workers),
        Command::Write { addr } => load::write(addr),
        Command::Fetch { addr, from_port } => client::fetch(addr, from_port),
        Command::DnsForge {
            server,
            name,
            from,
            count,
        } => client::dns_forge(server, &name, from, count),
        Command::Hbone {
            name,
            listen,
            cert,
            key,
            root,
            routes,
            stall_tls,
            goaway_first,
            refuse_first_stream,
        } => hbone::serve(hbone::ServeArgs {
            name,
            listen,
            cert,
            key,
            root,
            routes,
            fault: match (stall_tls, goaway_first, refuse_first_stream) {
                (true, _, _) => hbone::Fault::StallTls,
                (_, true, _) => hbone::Fault::GoawayFirst,
                (_, _, true) => hbone::Fault::RefuseFirstStream,
                _ => hbone::Fault::None,
            },
        }),
        Command::Ca {
            listen,
            ca_dir,
            trust_domain,
            names,
            token,
            allow,
            ttl,
        } => ca::serve(ca::CaArgs {
            listen,
            ca_dir,
            trust_domain,
            names,
            token,
            allow,
            max_ttl: ttl.map(std::time::Duration::from_secs),
        }),
        Command::HboneClient {
            connect,
            cert,
            key,
            root,
            authority,
            send,
        } => hbone::client(hbone::ClientArgs {
            connect,
            cert,
            key,
            root,
            authority,
            send,
        }),
        Command::Hostile {
            mode,
            connect,
            cert,
            key,
            authority,
            conns,
            streams,
            rounds,
            reset_ms,
            push_ms,
            from,
        } => hostile::run(hostile::HostileArgs {
            mode,
            connect,
            cert,
            key,
            authority,
            conns,
            streams,
            rounds,
            reset_ms,
            push_ms,
            from,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdt-peer: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Load clients and servers hold thousands of sockets: lift the soft open-files limit to the hard one.
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
