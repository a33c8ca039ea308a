"""How experts differ from their base, layer by layer: per-layer deltas, swap suggestions,
the heatmap and the files an analysis writes. Imports kernels/ (to read tensors) and io/."""
