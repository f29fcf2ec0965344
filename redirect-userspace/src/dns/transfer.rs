//! Zone transfers (AXFR, IXFR) over TCP: the upstream's answer is a stream of messages, not one
//! reply, and every one of them goes to the client, in order, as it came.
//!
//! The stream ends with the message whose last record is the zone's SOA again (RFC 5936 2.2 for
//! AXFR, RFC 1995 4 for IXFR), an IXFR that is a single SOA (the client is up to date), or an error.
use std::{io, net::SocketAddr, time::Duration};

use hickory_proto::{
    op::{Message, ResponseCode},
    rr::{RData, RecordType},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::UpstreamError;
use crate::net::connect_marked;

/// Whether a question asks for a zone transfer, whose answer is a stream of messages.
pub(super) fn is_transfer(qtype: RecordType) -> bool {
    matches!(qtype, RecordType::AXFR | RecordType::IXFR)
}

/// Tells the last message of a transfer from the ones before it.
#[derive(Debug)]
pub(super) struct Progress {
    qtype: RecordType,
    /// The serial of the SOA the transfer began with.
    first_serial: Option<u32>,
    records: usize,
}

impl Progress {
    pub(super) fn new(qtype: RecordType) -> Self {
        Progress {
            qtype,
            first_serial: None,
            records: 0,
        }
    }

    /// Takes the next message of the stream; true when it is the last one.
    pub(super) fn is_last(&mut self, message: &[u8]) -> bool {
        let Ok(message) = Message::from_vec(message) else {
            return true; // nothing after junk can be trusted to belong to the transfer
        };
        if message.metadata.response_code != ResponseCode::NoError || message.answers.is_empty() {
            return true;
        }
        let first_message = self.records == 0;
        let mut last_is_closing_soa = false;
        for record in &message.answers {
            last_is_closing_soa = match (&record.data, self.first_serial) {
                (RData::SOA(soa), None) if self.records == 0 => {
                    self.first_serial = Some(soa.serial);
                    false
                }
                (RData::SOA(soa), Some(first)) => soa.serial == first,
                _ => false,
            };
            self.records += 1;
        }
        if self.first_serial.is_none() {
            return true; // a transfer begins with the SOA; anything else is a one-message reply
        }
        // IXFR: a lone SOA means the client is up to date.
        let up_to_date = first_message && self.qtype == RecordType::IXFR && self.records == 1;
        last_is_closing_soa || up_to_date
    }
}

/// A transfer in progress: a connection to the upstream the query went out on.
pub(super) struct Transfer {
    stream: TcpStream,
    addr: SocketAddr,
    /// The longest wait for each next message.
    timeout: Duration,
    progress: Progress,
    done: bool,
}

impl Transfer {
    /// Sends `query` to `addr` over a connection of its own.
    pub(super) async fn start(
        addr: SocketAddr,
        timeout: Duration,
        query: &[u8],
        qtype: RecordType,
    ) -> Result<Transfer, UpstreamError> {
        let io_err = |source| UpstreamError::Io { addr, source };
        let mut stream = connect_marked(addr, timeout).await.map_err(io_err)?;
        let len = u16::try_from(query.len()).map_err(|_| {
            io_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "query over 65535 bytes",
            ))
        })?;
        let mut framed = Vec::with_capacity(query.len() + 2);
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(query);
        match tokio::time::timeout(timeout, stream.write_all(&framed)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(io_err(e)),
            Err(_) => return Err(UpstreamError::Timeout(addr, timeout)),
        }
        Ok(Transfer {
            stream,
            addr,
            timeout,
            progress: Progress::new(qtype),
            done: false,
        })
    }

    /// The next message of the stream; `None` once the last one was given.
    pub(super) async fn next(&mut self) -> Result<Option<Vec<u8>>, UpstreamError> {
        if self.done {
            return Ok(None);
        }
        let read = async {
            let len = self.stream.read_u16().await?;
            let mut message = vec![0u8; usize::from(len)];
            self.stream.read_exact(&mut message).await?;
            Ok::<_, io::Error>(message)
        };
        let message = match tokio::time::timeout(self.timeout, read).await {
            Ok(Ok(message)) => message,
            Ok(Err(source)) => {
                return Err(UpstreamError::Io {
                    addr: self.addr,
                    source,
                });
            }
            Err(_) => return Err(UpstreamError::Timeout(self.addr, self.timeout)),
        };
        self.done = self.progress.is_last(&message);
        if self.done {
            super::upstream::close_without_time_wait(&self.stream);
        }
        Ok(Some(message))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use hickory_proto::{
        op::Query,
        rr::{Name, Record, rdata},
    };

    use super::*;

    fn soa(serial: u32) -> Record {
        let name = Name::from_ascii("zone.example.").unwrap();
        Record::from_rdata(
            name.clone(),
            60,
            RData::SOA(rdata::SOA::new(name.clone(), name, serial, 60, 60, 60, 60)),
        )
    }

    fn a(last: u8) -> Record {
        Record::from_rdata(
            Name::from_ascii("www.zone.example.").unwrap(),
            60,
            RData::A(rdata::A::new(192, 0, 2, last)),
        )
    }

    /// A response to `id`'s AXFR question carrying `records`.
    pub(crate) fn message(id: u16, qtype: RecordType, records: Vec<Record>) -> Vec<u8> {
        let mut m = Message::response(id, hickory_proto::op::OpCode::Query);
        m.add_query(Query::query(
            Name::from_ascii("zone.example.").unwrap(),
            qtype,
        ));
        for r in records {
            m.add_answer(r);
        }
        m.to_vec().unwrap()
    }

    /// An AXFR in three messages: SOA and records, records, records and the SOA again.
    pub(crate) fn axfr_stream(id: u16) -> Vec<Vec<u8>> {
        vec![
            message(id, RecordType::AXFR, vec![soa(7), a(1), a(2)]),
            message(id, RecordType::AXFR, vec![a(3), a(4)]),
            message(id, RecordType::AXFR, vec![a(5), soa(7)]),
        ]
    }

    #[test]
    fn a_transfer_ends_with_the_message_that_closes_it_with_its_soa() {
        let mut p = Progress::new(RecordType::AXFR);
        let ends: Vec<bool> = axfr_stream(1).iter().map(|m| p.is_last(m)).collect();
        assert_eq!(ends, [false, false, true]);

        let mut p = Progress::new(RecordType::AXFR);
        let one = message(1, RecordType::AXFR, vec![soa(7), a(1), soa(7)]);
        assert!(p.is_last(&one), "a whole zone in one message");

        let mut p = Progress::new(RecordType::AXFR);
        assert!(!p.is_last(&message(1, RecordType::AXFR, vec![soa(7)])));
        assert!(p.is_last(&message(1, RecordType::AXFR, vec![a(1), soa(7)])));

        let mut p = Progress::new(RecordType::IXFR);
        assert!(
            p.is_last(&message(1, RecordType::IXFR, vec![soa(9)])),
            "IXFR: up to date"
        );
        let mut p = Progress::new(RecordType::IXFR);
        assert!(!p.is_last(&message(1, RecordType::IXFR, vec![soa(9), soa(8), a(1)])));
        assert!(p.is_last(&message(1, RecordType::IXFR, vec![soa(9), a(2), soa(9)])));
    }

    #[test]
    fn an_error_or_a_reply_without_a_transfer_is_the_only_message() {
        let mut refused = Message::from_vec(&message(1, RecordType::AXFR, vec![])).unwrap();
        refused.metadata.response_code = ResponseCode::Refused;
        assert!(Progress::new(RecordType::AXFR).is_last(&refused.to_vec().unwrap()));
        assert!(Progress::new(RecordType::AXFR).is_last(&message(1, RecordType::AXFR, vec![a(1)])));
        assert!(Progress::new(RecordType::AXFR).is_last(b"junk"));
    }
}
