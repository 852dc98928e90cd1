"""Benchmarks run by hand or by `policy-server bench`; never imported on the serving path."""
