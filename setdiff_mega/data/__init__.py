"""Data: embedded corpus, tokenizer, indexed datasets (megatron-core format), typed batches.

The package's names resolve on first use (PEP 562): importing ``setdiff_mega.data.batch`` (what the
objectives and the config need) does not import megatron-core's indexed datasets, which the data tools
and the trainer import when they read or write data.
"""
from setdiff_mega.lazy import lazy_exports

_EXPORTS = {"embedded_corpus": "corpus", "read_documents": "corpus", "Tokenizer": "tokenizer",
            "SPECIAL_TOKENS": "tokenizer", "DataError": "indexed", "write_indexed": "indexed",
            "check_dataset": "indexed", "read_manifest": "indexed", "Batch": "batch"}

__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
