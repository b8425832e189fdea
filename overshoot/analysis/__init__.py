"""Stage 2, offline: the per-step join (steps), the per-group summary and verdicts (analyze) and the what-if
replay (whatif). Reads a loaded run; never imports torch."""
