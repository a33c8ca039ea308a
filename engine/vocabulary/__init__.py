"""Checkpoints whose vocabularies differ: the output's tokenizer (a base's, a model's or the
union), each input's rows aligned to it, and the rows of tokens an input lacks. Imports
kernels/ (to compute rows), plan/, io/ and schema/."""
