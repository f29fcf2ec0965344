//! visibility: see ARCHITECTURE.md.
