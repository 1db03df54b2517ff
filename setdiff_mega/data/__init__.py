"""Data: embedded corpus, tokenizer, indexed datasets (megatron-core format) and training batches."""
from .corpus import embedded_corpus, read_documents
from .indexed import DataError, check_dataset, read_manifest, write_indexed
from .tokenizer import SPECIAL_TOKENS, Tokenizer

__all__ = ["embedded_corpus", "read_documents", "Tokenizer", "SPECIAL_TOKENS", "DataError", "write_indexed",
           "check_dataset", "read_manifest"]
