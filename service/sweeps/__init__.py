"""Sweeps: expert pairs × layer-swap configurations (and baselines), expanded into ordinary
merge and evaluation jobs, advanced by the reconciler, ranked on a leaderboard."""
