"""The training harness around the model: config, build, train loop, step, parallelism, verify, export;
sub-packages flow/ (objective, noise), observe/ (metrics, tracking, plots, profiling, useful FLOPs) and
runstate/ (checkpoints, resume, run folders, faults). May import every other wing."""
