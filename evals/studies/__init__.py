"""One-off studies: sweeps, comparisons and probes behind figures in BENCHMARKS.md. Product
benchmarks (bench ops, bench sandbox) are evals/bench_*.py; nothing here is imported by them."""
