"""The merge engine, pure and usable alone: safetensors format, checkpoints, recipes, plans,
methods, kernels, the streaming writer and the delta analysis. Imports nothing of the rest of
Layerswap; it sees local directories and takes a frozen options object, never settings."""
