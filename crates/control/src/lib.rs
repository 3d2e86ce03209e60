//! converge control layer (see DESIGN.md).
