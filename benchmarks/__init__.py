"""Development benchmark drivers (not shipped with the package): ``python -m benchmarks.X``."""
