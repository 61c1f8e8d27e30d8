"""The training harness around the model: config, build, train loop, objective, noise, parallelism, checkpoints, profiling, verify; may import every other wing."""
