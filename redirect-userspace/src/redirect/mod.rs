//! Loading and attaching the eBPF programs.
