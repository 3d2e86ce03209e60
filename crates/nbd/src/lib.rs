//! converge nbd layer (see DESIGN.md).
