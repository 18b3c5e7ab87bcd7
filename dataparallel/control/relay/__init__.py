"""The node relay: one process per node that carries its ranks' control traffic, so that a
collective crosses the network once per node instead of once per rank. ``local`` is its leg
to the node's ranks (shared memory and eventfds)."""
