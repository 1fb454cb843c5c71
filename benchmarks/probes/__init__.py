"""One-off probes: profiles, host-time and launch counts, kernel sweeps (benchmarks/README.md, "Probes")."""
