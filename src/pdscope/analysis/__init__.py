"""Statistics and findings over traces: one analysis path for every measurement source."""
