"""The `maingrad` command: one entry point that dispatches to the analyzer, hooks and service parts."""
