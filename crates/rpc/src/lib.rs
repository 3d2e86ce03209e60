//! converge rpc layer (see DESIGN.md).
