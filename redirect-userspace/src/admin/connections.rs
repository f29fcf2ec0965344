//! `/connections[?namespace=NS][&service=NS/NAME][&follow=1]`: the recent connection records,
//! kernel's and proxy's, as a JSON array; with `follow`, the same records and then each new one as
//! it comes, one JSON object a line (`application/x-ndjson`), until the client goes or the agent
//! stops. A follower that falls behind is told how many records it missed, in a line of its own
//! (`{"event":"missed","count":N}`), and goes on.
use std::{collections::HashSet, convert::Infallible, sync::Arc};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, channel::Channel, combinators::UnsyncBoxBody};
use hyper::{Response, StatusCode};
use tokio::sync::broadcast::error::RecvError;

use crate::records::{Connections, Filter, Record};

/// What the admin server answers with: a whole body, or one that goes on.
pub(super) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Lines a follower's connection may hold before the records wait for it (then it misses some,
/// never the agent waiting on it).
const FOLLOW_BUFFER: usize = 256;

/// The filter the query asks for.
pub(super) fn filter_of(param: impl Fn(&str) -> Option<String>) -> Filter {
    Filter {
        namespace: param("namespace"),
        service: param("service"),
    }
}

/// The recent records `filter` lets through, as a JSON array.
pub(super) fn recent(connections: &Connections, filter: &Filter) -> Result<String, String> {
    let records = connections.recent(filter);
    let records: Vec<&Record> = records.iter().map(|r| &**r).collect();
    serde_json::to_string_pretty(&records)
        .map(|body| body + "\n")
        .map_err(|e| e.to_string())
}

/// The recent records, then every new one `filter` lets through, as lines, until the body is
/// dropped (the client went) or `stop` changes.
pub(super) fn follow(
    connections: &Arc<Connections>,
    filter: Filter,
    mut stop: crate::drain::Watcher,
) -> Response<Body> {
    // Subscribed before the recent ones are read: none falls in between (one in both is sent once).
    let mut receiver = connections.follow();
    let recent = connections.recent(&filter);
    let (mut sender, body) = Channel::<Bytes, Infallible>::new(FOLLOW_BUFFER);
    tokio::spawn(async move {
        // By address: `recent` holds them all for as long as this task runs.
        let sent: HashSet<usize> = recent.iter().map(|r| Arc::as_ptr(r) as usize).collect();
        for record in &recent {
            if sender.send_data(line(&**record)).await.is_err() {
                return;
            }
        }
        loop {
            let received = tokio::select! {
                () = stop.stopped() => return,
                received = receiver.recv() => received,
            };
            let next = match received {
                Ok(record) if sent.contains(&(Arc::as_ptr(&record) as usize)) => continue,
                Ok(record) if !filter.matches(&record) => continue,
                Ok(record) => line(&*record),
                Err(RecvError::Lagged(count)) => line(&serde_json::json!({
                    "event": "missed",
                    "count": count,
                })),
                Err(RecvError::Closed) => return,
            };
            if sender.send_data(next).await.is_err() {
                return;
            }
        }
    });
    let mut response = Response::new(body.boxed_unsync());
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/x-ndjson"),
    );
    response
}

/// One JSON object and a newline.
fn line(value: &impl serde::Serialize) -> Bytes {
    let mut text = serde_json::to_vec(value).unwrap_or_else(|e| {
        format!("{{\"event\":\"error\",\"error\":{:?}}}", e.to_string()).into_bytes()
    });
    text.push(b'\n');
    Bytes::from(text)
}

/// A whole body.
pub(super) fn whole(body: Full<Bytes>) -> Body {
    body.boxed_unsync()
}
