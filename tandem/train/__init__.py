"""Training: data, the step loop, and everything a worker process runs."""
