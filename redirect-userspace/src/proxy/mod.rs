//! The outbound proxy.
