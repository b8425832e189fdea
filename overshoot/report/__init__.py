"""Stage 3, what a person reads: the terminal report (table) and the A/B comparison (compare)."""
