//! Locks whose data stays usable after a panic elsewhere: what the agent keeps under a mutex is
//! plain data (counters, caches, the maps' bookkeeping), consistent between any two statements, so
//! a poisoned lock is taken as it is instead of spreading the panic.
use std::sync::{Mutex, MutexGuard, PoisonError};

pub(crate) trait Locked<T> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panic_still_gives_its_data() {
        let counter = std::sync::Arc::new(Mutex::new(1));
        let held = counter.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock().unwrap();
            panic!("poisoning the lock on purpose");
        })
        .join();
        assert!(counter.is_poisoned());
        *counter.locked() += 1;
        assert_eq!(*counter.locked(), 2);
    }
}
