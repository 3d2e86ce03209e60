//! converge volume layer (see DESIGN.md).
