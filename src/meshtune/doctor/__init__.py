"""Diagnostics of a multi-node job: `meshtune doctor`'s checks across the nodes, the bandwidth between them, and the
rendezvous probes the launcher runs before and while torchrun waits for the nodes."""
