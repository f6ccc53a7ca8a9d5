"""Traffic analyzer: measures a workload's prefix overlap and turns it into a configuration."""
