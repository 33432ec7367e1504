"""maingrad.hooks: runtime exposure of main_grad and per-call records (imports only torch and the stdlib)."""
