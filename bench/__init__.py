"""retrolog's benchmarks: run each from the repository root as a module of this package,
``python -m bench.bench_log``; bench/README.md lists them with their current figures."""
