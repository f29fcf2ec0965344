//! The node's pods' certificates from Istio's CA: asked for on an identity's first use (one call
//! however many tunnels wait for it), kept, and renewed in the background once half their
//! lifetime has passed, as Istio's agents do.
//!
//! Over time (`docs/operating.md`):
//! - a failed renewal keeps the certificate in use until it expires, and is tried again after 1 s,
//!   doubling, at most a tenth of the lifetime or 5 minutes (less up to a fifth at random), and at
//!   the expiry itself; said at WARN at the first failure and then at most once a minute;
//! - once expired, nothing presents it: a tunnel or handshake needing it fails at once with
//!   [`CaError::Expired`], counted `expired`; such a use asks the CA itself at most once a second,
//!   so the first use after the CA is back gets a fresh certificate;
//! - an identity unused since its certificate was issued is not renewed again (its next use asks).
use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use rand::RngExt;
use rustls::{RootCertStore, crypto::CryptoProvider};
use tracing::{debug, info, warn};

use super::{
    CertError, HboneMetrics, Identity, TrustDomain,
    ca::{CaError, Issued, IstioCa},
    tls::{self, WorkloadTls},
};
use crate::lock::Locked;

/// The first retry after a failed call; doubled each failure in a row.
const FIRST_RETRY: Duration = Duration::from_secs(1);
/// Retries wait at most this long, and at most a tenth of the certificate's lifetime.
const MAX_RETRY: Duration = Duration::from_secs(300);
/// A use finding no valid certificate asks the CA itself at most this often.
const MIN_ASK: Duration = Duration::from_secs(1);
/// While failures go on, they are said again at WARN at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// A call to a CA.
pub(super) type Issuing<'a> = Pin<Box<dyn Future<Output = Result<Issued, CaError>> + Send + 'a>>;

/// What issues the certificates: Istio's CA; a stand-in in tests.
pub(super) trait Issuer: std::fmt::Debug + Send + Sync {
    fn issue<'a>(&'a self, identity: &'a Identity) -> Issuing<'a>;
    fn address(&self) -> &str;
}

impl Issuer for IstioCa {
    fn issue<'a>(&'a self, identity: &'a Identity) -> Issuing<'a> {
        Box::pin(IstioCa::issue(self, identity))
    }

    fn address(&self) -> &str {
        &self.settings().address
    }
}

/// The wall clock certificates are valid by; in tests, one the test moves.
#[derive(Debug, Clone, Default)]
pub(super) struct Clock {
    fake: Option<Arc<tokio::sync::watch::Sender<SystemTime>>>,
}

impl Clock {
    pub(super) fn now(&self) -> SystemTime {
        match &self.fake {
            None => SystemTime::now(),
            Some(fake) => *fake.borrow(),
        }
    }

    async fn sleep_until(&self, when: SystemTime) {
        match &self.fake {
            None => tokio::time::sleep(when.duration_since(self.now()).unwrap_or_default()).await,
            Some(fake) => {
                let _ = fake.subscribe().wait_for(|now| *now >= when).await;
            }
        }
    }

    #[cfg(test)]
    pub(super) fn fake() -> Clock {
        let (fake, _) = tokio::sync::watch::channel(SystemTime::now());
        Clock {
            fake: Some(Arc::new(fake)),
        }
    }

    #[cfg(test)]
    pub(super) fn advance(&self, by: Duration) {
        if let Some(fake) = &self.fake {
            fake.send_modify(|now| *now += by);
        }
    }
}

#[derive(Debug)]
pub(crate) struct CaIdentities {
    issuer: Arc<dyn Issuer>,
    clock: Clock,
    trust_domain: Arc<TrustDomain>,
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    metrics: Arc<HboneMetrics>,
    slots: Mutex<HashMap<(String, String), Arc<Slot>>>,
}

/// One identity's certificate. `asking` is held across a call to the CA, so that uses waiting for
/// a certificate share one call, and the background renewal never runs beside it.
#[derive(Debug, Default)]
struct Slot {
    state: Mutex<State>,
    asking: tokio::sync::Mutex<()>,
}

/// What is known of one identity's certificate.
#[derive(Debug, Default)]
pub(super) struct State {
    /// The last certificate issued, expired or not.
    current: Option<Current>,
    /// Calls failed in a row, the last one's time and error, and when the next is due.
    failures: u32,
    last_try: Option<SystemTime>,
    last_error: Option<String>,
    retry_at: Option<SystemTime>,
    /// When the failures were last said at WARN, and whether the expiry was said.
    warned: Option<SystemTime>,
    told_expired: bool,
    /// Used since the certificate in force was issued, or, with none, since the last call.
    used: bool,
    /// Whether a background task keeps it.
    refreshing: bool,
}

#[derive(Debug, Clone)]
pub(super) struct Current {
    pub config: Arc<WorkloadTls>,
    pub renew_at: SystemTime,
    pub not_after: SystemTime,
    pub lifetime: Duration,
}

impl State {
    /// The certificate in force at `now`: never one past its `notAfter`.
    pub(super) fn valid(&self, now: SystemTime) -> Option<&Current> {
        self.current.as_ref().filter(|c| now < c.not_after)
    }

    /// When the CA is asked next: at half the lifetime, or after a failure when its backoff says.
    pub(super) fn next_try(&self, now: SystemTime) -> SystemTime {
        match (&self.current, self.retry_at) {
            (_, Some(retry)) => retry,
            (Some(current), None) => current.renew_at,
            (None, None) => now,
        }
    }

    pub(super) fn installed(&mut self, fresh: Current) {
        *self = State {
            current: Some(fresh),
            refreshing: self.refreshing,
            ..State::default()
        };
    }

    /// A failed call at `now`; `jitter` in `[0, 1)` takes up to a fifth off the wait.
    pub(super) fn failed(&mut self, now: SystemTime, error: String, jitter: f64) {
        self.failures += 1;
        self.last_try = Some(now);
        self.last_error = Some(error);
        let lifetime = self.current.as_ref().map(|c| c.lifetime);
        let wait = backoff(self.failures, lifetime).mul_f64(1.0 - jitter.clamp(0.0, 1.0) / 5.0);
        let mut retry = now + wait;
        // The moment it expires is tried too: the sooner a certificate replaces it, the better.
        if let Some(current) = self.valid(now) {
            retry = retry.min(current.not_after);
        } else {
            self.used = false;
        }
        self.retry_at = Some(retry);
    }

    /// Whether the failures are due to be said at WARN (the first, then once a [`WARN_EVERY`]).
    fn due_warning(&mut self, now: SystemTime) -> bool {
        let due = self
            .warned
            .is_none_or(|at| now.duration_since(at).unwrap_or_default() >= WARN_EVERY);
        if due {
            self.warned = Some(now);
        }
        due
    }
}

/// How long after the `failures`th failure in a row the CA is asked again: 1 s doubling, at most
/// a tenth of the certificate's lifetime and 5 minutes, never under 1 s.
pub(super) fn backoff(failures: u32, lifetime: Option<Duration>) -> Duration {
    let cap = lifetime.map_or(MAX_RETRY, |l| (l / 10).min(MAX_RETRY));
    let doubled = FIRST_RETRY.saturating_mul(1 << failures.saturating_sub(1).min(16));
    doubled.min(cap).max(FIRST_RETRY)
}

impl CaIdentities {
    pub(crate) fn new(
        ca: IstioCa,
        trust_domain: Arc<TrustDomain>,
        metrics: Arc<HboneMetrics>,
    ) -> Result<CaIdentities, CertError> {
        let roots = tls::read_roots(&ca.settings().root)?;
        Ok(Self::with_issuer(
            Arc::new(ca),
            Clock::default(),
            roots,
            trust_domain,
            metrics,
        ))
    }

    pub(super) fn with_issuer(
        issuer: Arc<dyn Issuer>,
        clock: Clock,
        roots: RootCertStore,
        trust_domain: Arc<TrustDomain>,
        metrics: Arc<HboneMetrics>,
    ) -> CaIdentities {
        CaIdentities {
            issuer,
            clock,
            trust_domain,
            roots: Arc::new(roots),
            provider: Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
            metrics,
            slots: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn trust_domain(&self) -> &str {
        self.trust_domain.get()
    }

    /// The TLS configurations presenting `namespace/account`'s certificate: the one in force, the
    /// same `Arc` until renewed; with none in force, one asked for now. Never an expired one.
    pub(crate) async fn tls(
        self: &Arc<Self>,
        namespace: &str,
        account: &str,
    ) -> Result<Arc<WorkloadTls>, CaError> {
        let key = (namespace.to_string(), account.to_string());
        let slot = self.slots.locked().entry(key).or_default().clone();
        {
            let mut state = slot.state.locked();
            state.used = true;
            if let Some(kept) = state.valid(self.clock.now()) {
                let config = kept.config.clone();
                self.keep_refreshing(&mut state, &slot, namespace, account);
                return Ok(config);
            }
        }
        self.ask_now(&slot, namespace, account).await
    }

    /// Starts the background task keeping the slot, unless one runs.
    fn keep_refreshing(self: &Arc<Self>, state: &mut State, slot: &Arc<Slot>, ns: &str, sa: &str) {
        if !state.refreshing {
            state.refreshing = true;
            let (ns, sa) = (ns.to_string(), sa.to_string());
            tokio::spawn(self.clone().refresh(slot.clone(), ns, sa));
        }
    }

    /// No certificate in force: the CA asked now, one call for every use waiting; within
    /// [`MIN_ASK`] of a failed call, that failure at once.
    async fn ask_now(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        namespace: &str,
        account: &str,
    ) -> Result<Arc<WorkloadTls>, CaError> {
        let _asking = slot.asking.lock().await;
        let now = self.clock.now();
        {
            let mut state = slot.state.locked();
            if let Some(kept) = state.valid(now) {
                return Ok(kept.config.clone());
            }
            let recent = state
                .last_try
                .is_some_and(|at| now.duration_since(at).unwrap_or_default() < MIN_ASK);
            if recent {
                let refused = self.refused(&state, namespace, account, now, None);
                self.keep_refreshing(&mut state, slot, namespace, account);
                return Err(refused);
            }
        }
        let asked = self.ask(namespace, account).await;
        let now = self.clock.now();
        let mut state = slot.state.locked();
        self.keep_refreshing(&mut state, slot, namespace, account);
        match asked {
            Ok(fresh) => {
                let config = fresh.config.clone();
                self.installed(&mut state, fresh, namespace, account);
                state.used = true;
                Ok(config)
            }
            Err(e) => {
                self.failed(&mut state, namespace, account, now, &e);
                Err(self.refused(&state, namespace, account, now, Some(e)))
            }
        }
    }

    /// Why there is no certificate to present, counted `expired` when the last one expired.
    fn refused(
        &self,
        state: &State,
        namespace: &str,
        account: &str,
        now: SystemTime,
        error: Option<CaError>,
    ) -> CaError {
        let identity = self.identity(namespace, account).to_string();
        let why = state.last_error.clone().unwrap_or_default();
        match (&state.current, error) {
            (Some(expired), _) => {
                self.metrics.certificate("expired");
                let ago = now.duration_since(expired.not_after).unwrap_or_default();
                debug!(
                    identity,
                    ?ago,
                    "no tunnel: the workload certificate expired"
                );
                CaError::Expired {
                    identity,
                    ago_secs: ago.as_secs(),
                    why,
                }
            }
            (None, Some(error)) => error,
            (None, None) => CaError::Unavailable {
                identity,
                ago_ms: state
                    .last_try
                    .and_then(|at| now.duration_since(at).ok())
                    .unwrap_or_default()
                    .as_millis(),
                why,
            },
        }
    }

    /// Keeps a slot's certificate renewed while its identity is used: at half the lifetime, and
    /// after a failure as [`backoff`] says. Ends once a renewal is due and the identity was not
    /// used since the certificate was issued (or, with none in force, since the last call).
    async fn refresh(self: Arc<Self>, slot: Arc<Slot>, namespace: String, account: String) {
        loop {
            let next = slot.state.locked().next_try(self.clock.now());
            self.clock.sleep_until(next).await;
            let _asking = slot.asking.lock().await;
            let now = self.clock.now();
            {
                let mut state = slot.state.locked();
                if now < state.next_try(now) {
                    continue;
                }
                if !state.used {
                    debug!(
                        namespace,
                        account, "workload certificate unused: not renewed"
                    );
                    state.refreshing = false;
                    return;
                }
            }
            let asked = self.ask(&namespace, &account).await;
            let now = self.clock.now();
            let mut state = slot.state.locked();
            match asked {
                Ok(fresh) => self.installed(&mut state, fresh, &namespace, &account),
                Err(e) => self.failed(&mut state, &namespace, &account, now, &e),
            }
        }
    }

    /// A certificate issued: in force from now, counted, and said when it ends failures.
    fn installed(&self, state: &mut State, fresh: Current, namespace: &str, account: &str) {
        let renewal = state.current.is_some();
        self.metrics
            .certificate(if renewal { "renewed" } else { "issued" });
        if state.failures > 0 {
            info!(
                namespace,
                account,
                failures = state.failures,
                "workload certificate issued again; the CA answers"
            );
        }
        state.installed(fresh);
    }

    /// A failed call: counted, the next one scheduled, said at WARN (rate-limited).
    fn failed(&self, state: &mut State, ns: &str, sa: &str, now: SystemTime, error: &CaError) {
        self.metrics.certificate("failed");
        state.failed(now, error.to_string(), rand::rng().random_range(0.0..1.0));
        let next_try = state
            .retry_at
            .and_then(|at| at.duration_since(now).ok())
            .unwrap_or_default();
        let (failures, warn_now) = (state.failures, state.due_warning(now));
        match state.current.as_ref() {
            Some(current) if now < current.not_after => {
                let left = current.not_after.duration_since(now).unwrap_or_default();
                if warn_now {
                    warn!(namespace = ns, account = sa, %error, failures, expires_in = ?left, ?next_try, "renewing a workload certificate failed; the one in use is kept until it expires");
                }
            }
            Some(expired) => {
                let ago = now.duration_since(expired.not_after).unwrap_or_default();
                if warn_now || !state.told_expired {
                    state.told_expired = true;
                    warn!(namespace = ns, account = sa, %error, failures, expired_ago = ?ago, ?next_try, "a workload certificate expired and the CA has not renewed it: new tunnels of this identity fail until it does");
                }
            }
            None if warn_now => {
                warn!(namespace = ns, account = sa, %error, failures, ?next_try, "asking the CA for a workload certificate failed");
            }
            None => {}
        }
        debug!(namespace = ns, account = sa, %error, failures, ?next_try, "CA call failed");
    }

    fn identity(&self, namespace: &str, account: &str) -> Identity {
        Identity {
            trust_domain: self.trust_domain.get().to_string(),
            namespace: namespace.to_string(),
            service_account: account.to_string(),
        }
    }

    async fn ask(&self, namespace: &str, account: &str) -> Result<Current, CaError> {
        let identity = self.identity(namespace, account);
        let issued = self.issuer.issue(&identity).await?;
        let received = self.clock.now();
        let Issued {
            chain,
            key,
            not_before,
            not_after,
        } = issued;
        let tls = tls::workload_tls(
            &self.provider,
            self.trust_domain.get(),
            chain,
            key,
            self.roots.clone(),
        )
        .map_err(|e| CaError::Chain {
            address: self.issuer.address().to_string(),
            why: format!("the certificate does not fit its key: {e}"),
        })?;
        // Half the lifetime left from now: a CA backdates notBefore for clocks apart, which is
        // no lifetime this agent ever had.
        let start = not_before.max(received);
        let left = not_after.duration_since(start).unwrap_or_default();
        info!(%identity, valid_for = ?left, "workload certificate issued");
        Ok(Current {
            config: Arc::new(tls),
            renew_at: start + left / 2,
            not_after,
            lifetime: left,
        })
    }
}

#[cfg(test)]
#[path = "ca_cache_tests.rs"]
mod tests;
