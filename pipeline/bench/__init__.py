"""`pipeline bench`: load a serving engine and report latency percentiles and throughput."""
