"""Framework adapters. Each emits spans through the tracer only; optional frameworks are imported
only inside their own module."""
