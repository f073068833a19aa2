"""What a run reports: clocks, per-epoch accounting, memory, logs, progress, the report."""
