//! The certificate cache over time, on a clock the test moves and a CA it stops and starts: the
//! backoff schedule, the certificate kept until it expires, nothing presented after, recovery.
use std::sync::atomic::{AtomicBool, Ordering};

use rcgen::{CertificateParams, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::*;

/// A CA that issues for `ttl` from the clock's now, or refuses while down; it records each call.
#[derive(Debug)]
struct FakeCa {
    clock: Clock,
    ttl: Duration,
    up: AtomicBool,
    calls: Mutex<Vec<(SystemTime, bool)>>,
    cert: CertificateDer<'static>,
    key: Vec<u8>,
}

impl Issuer for FakeCa {
    fn issue<'a>(&'a self, _identity: &'a Identity) -> Issuing<'a> {
        Box::pin(async move {
            let now = self.clock.now();
            let up = self.up.load(Ordering::Relaxed);
            self.calls.locked().push((now, up));
            if !up {
                return Err(CaError::Refused {
                    address: self.address().to_string(),
                    code: tonic::Code::Unavailable,
                    message: "connection refused".into(),
                });
            }
            Ok(Issued {
                chain: vec![self.cert.clone()],
                key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.clone())),
                not_before: now,
                not_after: now + self.ttl,
            })
        })
    }

    fn address(&self) -> &str {
        "https://fake-ca:15012"
    }
}

struct Setup {
    clock: Clock,
    ca: Arc<FakeCa>,
    cache: Arc<CaIdentities>,
    metrics: Arc<HboneMetrics>,
}

fn setup(ttl: Duration) -> Setup {
    let clock = Clock::fake();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![SanType::URI(
        "spiffe://cluster.local/ns/team-a/sa/default"
            .try_into()
            .unwrap(),
    )];
    let cert = params.self_signed(&key).unwrap();
    let mut roots = RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let ca = Arc::new(FakeCa {
        clock: clock.clone(),
        ttl,
        up: AtomicBool::new(true),
        calls: Mutex::new(Vec::new()),
        cert: cert.der().clone(),
        key: key.serialize_der(),
    });
    let metrics = Arc::new(HboneMetrics::default());
    let cache = Arc::new(CaIdentities::with_issuer(
        ca.clone(),
        clock.clone(),
        roots,
        Arc::new(TrustDomain::fixed("cluster.local".into())),
        metrics.clone(),
    ));
    Setup {
        clock,
        ca,
        cache,
        metrics,
    }
}

impl Setup {
    async fn tls(&self) -> Result<Arc<WorkloadTls>, CaError> {
        self.cache.tls("team-a", "default").await
    }

    /// Moves the clock by `by` in steps of `step`, letting the background task act after each.
    async fn advance(&self, by: Duration, step: Duration) {
        let mut moved = Duration::ZERO;
        while moved < by {
            self.clock.advance(step);
            moved += step;
            settle().await;
        }
    }

    /// The CA's calls, as seconds since `from`, and whether it was up.
    fn calls_since(&self, from: SystemTime) -> Vec<(f64, bool)> {
        self.ca
            .calls
            .locked()
            .iter()
            .map(|(at, up)| {
                (
                    at.duration_since(from).unwrap_or_default().as_secs_f64(),
                    *up,
                )
            })
            .collect()
    }

    fn certificates(&self, result: &'static str) -> u64 {
        self.metrics.certificates(result)
    }
}

/// Lets every task that can run, run (the CA answers at once).
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[test]
fn backoff_doubles_from_one_second_to_a_tenth_of_the_lifetime_or_five_minutes() {
    let secs = |failures, lifetime: Option<u64>| {
        backoff(failures, lifetime.map(Duration::from_secs)).as_secs()
    };
    let day = Some(24 * 3600);
    let schedule: Vec<u64> = (1..=11).map(|n| secs(n, day)).collect();
    assert_eq!(schedule, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
    // A 20 s certificate: at most 2 s between tries; a 5 s one: never under 1 s.
    let schedule: Vec<u64> = (1..=4).map(|n| secs(n, Some(20))).collect();
    assert_eq!(schedule, [1, 2, 2, 2]);
    assert_eq!(secs(5, Some(5)), 1);
    assert_eq!(secs(40, None), 300);
}

#[test]
fn a_retry_is_jittered_down_by_at_most_a_fifth_and_never_past_the_expiry() {
    let now = SystemTime::now();
    let current = |left: u64| Current {
        config: Arc::new(dummy_tls()),
        renew_at: now,
        not_after: now + Duration::from_secs(left),
        lifetime: Duration::from_secs(200),
    };
    let mut state = State::default();
    state.installed(current(100));
    for (jitter, want_ms) in [(0.0, 1000), (0.5, 900), (0.999, 800)] {
        let mut s = State::default();
        s.installed(current(100));
        s.failed(now, "down".into(), jitter);
        let wait = s.retry_at.unwrap().duration_since(now).unwrap().as_millis();
        assert!(want_ms - 1 <= wait && wait <= want_ms, "{jitter}: {wait}");
    }
    // Five failures in a row would wait 16 s (a 200 s lifetime caps at 20 s); 3 s are left: the
    // next try is at the expiry.
    state.installed(current(3));
    for _ in 0..5 {
        state.failed(now, "down".into(), 0.0);
    }
    assert_eq!(state.retry_at, Some(now + Duration::from_secs(3)));
    assert!(state.used || state.valid(now).is_some());
}

fn dummy_tls() -> WorkloadTls {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["x".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let mut roots = RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    tls::workload_tls(
        &Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
        "cluster.local",
        vec![cert.der().clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        Arc::new(roots),
    )
    .unwrap()
}

/// A 100 s certificate, the CA down from before its renewal: the certificate stays in use until
/// its last second, the CA is asked at 50 s and then after 1, 2, 4, 8 s and every 10 s at most
/// (a tenth of the lifetime), and at the expiry; after it, no use gets it (counted `expired`);
/// once the CA is back, the next use gets a new one.
#[tokio::test]
async fn the_certificate_is_kept_until_it_expires_then_nothing_is_presented_until_the_ca_is_back() {
    let s = setup(Duration::from_secs(100));
    let start = s.clock.now();
    let first = s.tls().await.unwrap();
    s.ca.up.store(false, Ordering::Relaxed);
    let step = Duration::from_millis(250);
    // Uses all along, each getting the first certificate while it is valid.
    while s.clock.now() < start + Duration::from_millis(99_750) {
        let kept = s.tls().await.unwrap();
        assert!(
            Arc::ptr_eq(&kept, &first),
            "the same certificate while valid"
        );
        s.advance(Duration::from_secs(1), step).await;
    }
    let calls = s.calls_since(start);
    let tries: Vec<f64> = calls.iter().skip(1).map(|(at, _)| *at).collect();
    assert!(
        (50.0..=50.25).contains(&tries[0]),
        "renewal at half the lifetime: {tries:?}"
    );
    for (n, pair) in tries.windows(2).enumerate() {
        let gap = pair[1] - pair[0];
        let full = backoff(
            u32::try_from(n + 1).unwrap(),
            Some(Duration::from_secs(100)),
        );
        let full = full.as_secs_f64();
        assert!(
            gap >= full * 0.8 - 0.25 && gap <= full + 0.25 || pair[1] >= 99.75,
            "try {n}: {gap:.2} s after the one before, backoff says {full} s: {tries:?}"
        );
    }
    assert!(
        (8..=12).contains(&tries.len()),
        "tries before expiry: {tries:?}"
    );
    // The expiry itself is tried.
    s.advance(Duration::from_secs(1), step).await;
    let tries = s.calls_since(start);
    assert!(
        tries.iter().any(|(at, _)| (100.0..=100.25).contains(at)),
        "{tries:?}"
    );

    // Expired: nothing presented, counted, said why.
    let refused = s.tls().await.unwrap_err();
    assert!(matches!(refused, CaError::Expired { .. }), "{refused}");
    let text = refused.to_string();
    assert!(
        text.contains("spiffe://cluster.local/ns/team-a/sa/default")
            && text.contains("expired")
            && text.contains("connection refused"),
        "{text}"
    );
    assert!(s.certificates("expired") >= 1);
    let failed = s.certificates("failed");
    assert!(failed >= 9, "failed calls counted: {failed}");

    // The CA back: the next use past a second after the last try gets a new certificate.
    s.ca.up.store(true, Ordering::Relaxed);
    s.advance(Duration::from_secs(1), step).await;
    let fresh = s.tls().await.unwrap();
    assert!(!Arc::ptr_eq(&fresh, &first), "a new certificate");
    assert_eq!(s.certificates("renewed"), 1);
    assert_eq!(s.certificates("issued"), 1);
}

/// After the expiry, a burst of uses shares one call to a CA that is still down, and uses within a
/// second of it get its failure without calling again; a use with none left does not hang.
#[tokio::test]
async fn after_expiry_the_ca_is_asked_at_most_once_a_second_by_uses() {
    let s = setup(Duration::from_secs(20));
    let start = s.clock.now();
    s.tls().await.unwrap();
    s.ca.up.store(false, Ordering::Relaxed);
    s.advance(Duration::from_secs(25), Duration::from_millis(250))
        .await;
    let before = s.ca.calls.locked().len();
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let cache = s.cache.clone();
            tokio::spawn(async move { cache.tls("team-a", "default").await })
        })
        .collect();
    for use_ in burst {
        let refused = use_.await.unwrap().unwrap_err();
        assert!(matches!(refused, CaError::Expired { .. }), "{refused}");
    }
    let after = s.ca.calls.locked().len();
    assert!(
        after - before <= 1,
        "eight uses made {} calls: {:?}",
        after - before,
        s.calls_since(start)
    );
    assert!(s.certificates("expired") >= 8);
}

/// An identity used once is renewed once at half its lifetime, and then let go: no call to the CA
/// for a certificate nobody asks for; its next use asks again.
#[tokio::test]
async fn an_identity_unused_since_its_certificate_was_issued_is_not_renewed_again() {
    let s = setup(Duration::from_secs(10));
    let start = s.clock.now();
    let first = s.tls().await.unwrap();
    s.advance(Duration::from_secs(60), Duration::from_millis(250))
        .await;
    let calls = s.calls_since(start);
    assert_eq!(calls.len(), 2, "issued, renewed once: {calls:?}");
    assert!((5.0..=5.25).contains(&calls[1].0), "{calls:?}");
    let again = s.tls().await.unwrap();
    assert!(!Arc::ptr_eq(&again, &first));
    assert_eq!(s.calls_since(start).len(), 3);
}

/// A CA down at an identity's first use: every use waiting shares one call and gets its error; a
/// use within a second gets it without a call; the CA back, the next use a second later works.
#[tokio::test]
async fn with_no_certificate_yet_uses_share_one_call_and_recover_with_the_ca() {
    let s = setup(Duration::from_secs(20));
    s.ca.up.store(false, Ordering::Relaxed);
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let cache = s.cache.clone();
            tokio::spawn(async move { cache.tls("team-a", "default").await })
        })
        .collect();
    for use_ in burst {
        let e = use_.await.unwrap().unwrap_err();
        assert!(
            matches!(e, CaError::Refused { .. } | CaError::Unavailable { .. }),
            "{e}"
        );
    }
    assert_eq!(s.ca.calls.locked().len(), 1);
    assert_eq!(s.certificates("failed"), 1);
    assert_eq!(s.certificates("expired"), 0, "nothing expired");
    s.ca.up.store(true, Ordering::Relaxed);
    let soon = s.tls().await.unwrap_err();
    assert!(matches!(soon, CaError::Unavailable { .. }), "{soon}");
    s.advance(Duration::from_secs(1), Duration::from_millis(250))
        .await;
    s.tls().await.unwrap();
    assert_eq!(s.certificates("issued"), 1);
}
