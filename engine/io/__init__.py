"""Files: reads confined to the allowed roots, the safetensors format, checkpoints opened
lazily (a LoRA adapter's weights applied as they are read), the atomic output writer, content
digests and the allocator settings. The only folder that opens a file; imports the engine's
errors, limits and architectures."""
