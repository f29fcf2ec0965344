//! config: see ARCHITECTURE.md.
