//! The agent's life as its serving parts see it, in one watch channel: starting, serving, handed
//! over (a successor serves on the same sockets) or shutting down. The agent moves it forward
//! (`Lifecycle`); each accept loop and background task holds a `Watcher` that wakes when its part
//! must stop; readiness reads the phase. What holds a drain open is counted elsewhere: the budgets'
//! units of the connections still relaying (`Share::until_empty`), the streams of HBONE received
//! among them; their connections are told to open no more streams as the agent stops serving.
use tokio::sync::watch;

/// Phases in the order they come: starting, serving, then one of the two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    Starting,
    /// Programs attached, listeners accepting: ready.
    Serving,
    /// A successor took over: stop accepting, the admin server too (the successor answers on the
    /// same socket), and drain what is relaying.
    HandedOver,
    /// A signal: stop accepting; the admin server answers until the process is gone.
    ShuttingDown,
}

/// The one sender of the phase.
#[derive(Debug)]
pub(crate) struct Lifecycle(watch::Sender<Phase>);

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle(watch::Sender::new(Phase::Starting))
    }
}

impl Lifecycle {
    /// Moves on to `phase`. The agent never goes back, and either end is the last phase (a signal
    /// while draining leaves it handed over).
    pub(crate) fn enter(&self, phase: Phase) {
        self.0.send_if_modified(|now| {
            let later = phase > *now && *now < Phase::HandedOver;
            if later {
                *now = phase;
            }
            later
        });
    }

    /// For an accept loop or a task of the running agent: stops on a hand-over or a shutdown.
    pub(crate) fn serving(&self) -> Watcher {
        Watcher {
            phases: self.0.subscribe(),
            stop_at: |phase| phase >= Phase::HandedOver,
        }
    }

    /// For the admin server: stops on a hand-over only (it reports a shutdown while it happens).
    pub(crate) fn admin(&self) -> Watcher {
        Watcher {
            phases: self.0.subscribe(),
            stop_at: |phase| phase == Phase::HandedOver,
        }
    }

    /// Once a successor has taken over.
    pub(crate) async fn handed_over(&self) {
        let mut phases = self.0.subscribe();
        let _ = phases.wait_for(|phase| *phase == Phase::HandedOver).await;
    }
}

/// One part's view of the phase. Dropping the `Lifecycle` stops every watcher.
#[derive(Debug, Clone)]
pub(crate) struct Watcher {
    phases: watch::Receiver<Phase>,
    stop_at: fn(Phase) -> bool,
}

impl Watcher {
    /// Resolves once this part must stop (at once if it already must). Cancel-safe: a `select!`
    /// loop may call it again on each turn.
    pub(crate) async fn stopped(&mut self) {
        let stop_at = self.stop_at;
        let _ = self.phases.wait_for(|phase| stop_at(*phase)).await;
    }

    pub(crate) fn phase(&self) -> Phase {
        *self.phases.borrow()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn stops_within(watcher: &mut Watcher, wait: Duration) -> bool {
        tokio::time::timeout(wait, watcher.stopped()).await.is_ok()
    }

    #[tokio::test]
    async fn serving_parts_stop_on_either_end_and_the_admin_server_only_on_a_hand_over() {
        let short = Duration::from_millis(20);
        let life = Lifecycle::default();
        let (mut serving, mut admin) = (life.serving(), life.admin());
        life.enter(Phase::Serving);
        assert!(!stops_within(&mut serving, short).await);
        life.enter(Phase::ShuttingDown);
        assert!(stops_within(&mut serving, short).await);
        assert!(!stops_within(&mut admin, short).await);

        let life = Lifecycle::default();
        let (mut serving, mut admin) = (life.serving(), life.admin());
        life.enter(Phase::Serving);
        life.enter(Phase::HandedOver);
        assert!(stops_within(&mut serving, short).await);
        assert!(stops_within(&mut admin, short).await);
        tokio::time::timeout(short, life.handed_over())
            .await
            .unwrap();
        // A signal after the hand-over does not take the agent back.
        life.enter(Phase::ShuttingDown);
        life.enter(Phase::Serving);
        assert_eq!(admin.phase(), Phase::HandedOver);
    }

    #[tokio::test]
    async fn a_dropped_lifecycle_stops_every_watcher() {
        let life = Lifecycle::default();
        let mut admin = life.admin();
        drop(life);
        assert!(stops_within(&mut admin, Duration::from_millis(20)).await);
    }
}
