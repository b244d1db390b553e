"""Benchmarks the CLI exposes (`nfabric bench ...`); `bench/` runs them all for `make bench`."""
