"""What a plan is computed from: the cluster (hardware presets, calibration files), the model's shape, how it
trains (Training) and how it is split (Strategy), and the command-line values that name them (args.py).
Imports nothing of the planner above it."""
