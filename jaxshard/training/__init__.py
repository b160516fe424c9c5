"""The training step and what it carries: train state, step, optimizer, loss scaling, the
explicit reducer and local SGD beside the step they replace, checkpoints, metrics, traces."""
