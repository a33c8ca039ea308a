"""The plan: per output tensor, its op, its terms and where its inputs lie, made before any
output byte exists; and the checks made on it (the inputs agree, the output is not too
large). Imports io/ and architectures."""
