//! Cross-plane integration tests live in `tests/`: PP, FM and SC nodes together over
//! real gRPC on loopback, and what spans the planes (the metrics expositions against
//! the Grafana dashboard). This crate has no code of its own; it exists so that no
//! plane dev-depends on the others.
