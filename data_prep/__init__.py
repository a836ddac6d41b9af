"""Building corpora, task sets and tokenized shards from raw text, offline."""
