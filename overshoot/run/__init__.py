"""`overshoot run`: start a served model with the hooks (launch), drive it at each concurrency level (load),
and tie both to the run directory (command)."""
