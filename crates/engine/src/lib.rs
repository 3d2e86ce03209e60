//! converge engine layer (see DESIGN.md).
