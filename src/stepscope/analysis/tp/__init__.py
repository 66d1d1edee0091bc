"""The embedded trace-processor clone: Perfetto trace bytes -> trace processor's tables."""
