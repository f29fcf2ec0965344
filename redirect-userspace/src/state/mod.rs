//! state: see ARCHITECTURE.md.
