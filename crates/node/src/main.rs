//! `converged`: the converge node daemon (the node itself is the `converge_node` library).

fn main() {
    converge_node::daemon::main()
}
