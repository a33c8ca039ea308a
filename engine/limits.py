"""Upper bounds on every number read from an input. Inputs come from users and from the Hub, so
a config, index or header may claim anything; nothing is allocated or iterated in proportion to
a value before it is checked against these. Each is far above any real model."""

from __future__ import annotations

MAX_LAYERS = 4096  # num_hidden_layers (the largest open models have ~100-200)
MAX_TENSORS = 1_000_000  # tensors in one checkpoint
# Safetensors shards of one checkpoint, and of one output (each is an open descriptor while a
# merge runs; the largest open models have ~200 at 5 GB each, ~400 at the 2 GB default).
MAX_WEIGHT_FILES = 512
MAX_RANK = 8  # dimensions of one tensor
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, the shard index (large models: ~100 KB)
MAX_SIDE_FILE_BYTES = 1024 * 1024 * 1024  # one tokenizer/config file copied to the output
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024  # tokenizer.json (a 256k-token vocabulary: ~35 MB)
MAX_VOCABULARY = 4_000_000  # tokens of one tokenizer (the largest vocabularies: ~260k)
