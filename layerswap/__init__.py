"""The composition root: the `layerswap` command, which wires the API (service/) and the job
runtime (worker/) together. The only package that imports both."""
